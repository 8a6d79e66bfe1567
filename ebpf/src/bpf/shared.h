// SPDX-License-Identifier: GPL-2.0
// Structs and constants shared between the kernel programs and the agent. The Rust mirror is
// in ../lib.rs, checked against these sizes by a test there.
#pragma once

// Frame-pointer stacks come from bpf_get_stack (perf's limit, 127); the DWARF unwinder
// walks up to this many frames with bpf_loop.
#define MAX_USER_FRAMES 256
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
// The user stack was walked by the DWARF unwinder (not frame pointers).
#define SAMPLE_DWARF 4
// The DWARF walk reached the outermost frame (an undefined return address, e.g. _start).
#define SAMPLE_COMPLETE 8
// An off-CPU interval (sched_switch): the stack is the one saved when the thread blocked,
// timestamp_ns is when it blocked and value_ns how long it stayed off the CPU.
#define SAMPLE_OFFCPU 16

#define COUNTER_SAMPLES 0
#define COUNTER_RINGBUF_DROPS 1
#define COUNTER_KERNEL_STACK_ERRORS 2
#define COUNTER_USER_STACK_ERRORS 3
#define COUNTER_USER_STACK_TRUNCATED 4
#define COUNTER_TARGETS_FULL 5
// DWARF unwinder: per-reason failures, counted once per sample that stopped there.
#define COUNTER_UNWIND_NO_MAPPING 6  // a pc in no known executable mapping
#define COUNTER_UNWIND_NO_TABLE 7    // a mapping whose table is not loaded (yet): FP fallback
#define COUNTER_UNWIND_NO_ROW 8      // a pc no CFI row covers
#define COUNTER_UNWIND_BAD_CFA 9     // an unsupported rule, or unreadable stack memory
#define COUNTER_UNWIND_TRUNCATED 10  // more than MAX_USER_FRAMES frames
#define COUNTER_UNWIND_COMPLETE 11   // walks that reached the outermost frame
#define COUNTER_UNWIND_SAMPLES 12    // samples the DWARF unwinder walked
#define COUNTER_OFFCPU_EVENTS 13     // off-CPU intervals sent (at least offcpu_min_ns long)
#define COUNTER_OFFCPU_MAP_FULL 14   // a blocking thread not tracked: offcpu_pending was full
#define COUNTER_COUNT 16

// Unwind rows (see the pyrometer-unwind crate for how they are built). 12 bytes.
#define CFA_NONE 0
#define CFA_RSP 1
#define CFA_RBP 2
#define CFA_PLT 3
#define CFA_SIGNAL 4
#define CFA_END 5
#define CFA_UNSUPPORTED 6
#define RBP_SAME 0
#define RBP_OFFSET 1
#define RBP_UNSUPPORTED 2

struct unwind_row {
	__u32 pc; // ELF virtual address where the row starts applying
	__u8 cfa_type;
	__u8 rbp_type;
	__s16 cfa_offset;
	__s16 rbp_offset;
	__u16 reserved;
};

#define MAX_MAPPINGS 128 // executable mappings per process (must stay a power of two)

// One executable mapping of a process. row_count == 0: no table, walk by frame pointer.
struct exec_mapping {
	__u64 start;
	__u64 end;
	__u64 bias; // ELF virtual address = runtime address - bias
	__u32 row_first;
	__u32 row_count;
};

// A process's executable mappings, sorted by start.
struct process_unwind {
	__u32 count;
	__u32 reserved;
	struct exec_mapping maps[MAX_MAPPINGS];
};

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
	__u64 value_ns; // SAMPLE_OFFCPU: blocked time; 0 for on-CPU samples
};

struct sample_record {
	struct sample_header hdr;
	__u64 user[MAX_USER_FRAMES];     // leaf first
	__u64 kernel[MAX_KERNEL_FRAMES]; // leaf first, only with SAMPLE_KERNEL_INLINE
};

// What sched_switch keeps for a blocked thread until it runs again: the header and user
// frames of the record it will send (no inline kernel frames: a stack-map collision is
// counted as a kernel stack error instead, which keeps each pending entry at 2 KiB).
struct offcpu_record {
	struct sample_header hdr;
	__u64 user[MAX_USER_FRAMES];
};
