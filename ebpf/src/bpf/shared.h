// SPDX-License-Identifier: GPL-2.0
// Structs and constants shared between the kernel programs and the agent. The Rust mirror is
// in ../lib.rs, checked against these sizes by a test there.
#pragma once

#define MAX_USER_FRAMES 127
#define MAX_KERNEL_FRAMES 127
#define COMM_LEN 16

#define FILTER_ALL 0
#define FILTER_TARGETS 1

#define TARGET_SELECTED 1
#define TARGET_FOLLOW_CHILDREN 2

// sample_header.flags
#define SAMPLE_KERNEL_INLINE 1
// Not a sample: the process exec'd a new image (header only).
#define SAMPLE_EVENT_EXEC 2

#define COUNTER_SAMPLES 0
#define COUNTER_RINGBUF_DROPS 1
#define COUNTER_KERNEL_STACK_ERRORS 2
#define COUNTER_USER_STACK_ERRORS 3
#define COUNTER_USER_STACK_TRUNCATED 4
#define COUNTER_TARGETS_FULL 5
#define COUNTER_COUNT 8

struct sample_header {
	__u64 timestamp_ns; // CLOCK_MONOTONIC
	__u32 pid;          // thread group id
	__u32 tid;
	__u32 cpu;
	__s32 kernel_stack_id; // index in kernel_stacks, or a negative errno
	__u32 user_frames;     // number of user frames that follow the header
	__u32 kernel_frames;   // number of inline kernel frames (SAMPLE_KERNEL_INLINE)
	__u32 flags;
	__u32 reserved;
	char comm[COMM_LEN];
};

struct sample_record {
	struct sample_header hdr;
	__u64 user[MAX_USER_FRAMES];     // leaf first
	__u64 kernel[MAX_KERNEL_FRAMES]; // leaf first, only with SAMPLE_KERNEL_INLINE
};
