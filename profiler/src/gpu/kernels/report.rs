//! What `record --gpu-kernels` says at the end: per device the kernels and copies, their summed
//! and busy (union) time, the sampled estimate beside them; the launches seen and sampled; and
//! everything lost or refused on the way (CUPTI's drops, lost chunks, stacks that never came),
//! with the processes whose library could not start. Also as JSON for `--stats`.

use std::collections::HashMap;

use crate::capture::gpu::channel::State;
use crate::capture::gpu::samples::GpuCapture;

/// The summary, one line a fact, each starting with `pyrometer: ` or two spaces.
pub fn render(g: &mut GpuCapture) -> String {
    let st = g.stats();
    let mut out = String::new();
    let statuses = g.joiner.statuses();
    let every: Vec<u32> = {
        let mut v: Vec<u32> = statuses.iter().map(|(_, s)| s.sample_every).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let every = match every.as_slice() {
        [] => String::new(),
        [n] => format!(" (1 in {n} launches per thread sampled)"),
        _ => " (processes sample different 1-in-N)".to_string(),
    };
    out.push_str(&format!("pyrometer: GPU kernels{every}:\n"));
    if g.account.devices.is_empty() {
        out.push_str(
            "  no GPU work was reported: a process reports it from its cuInit on when started with CUDA_INJECTION64_PATH naming libpyrometer_cupti.so (record sets it for a command it starts)\n",
        );
    }
    let nvml = g.nvml_index.clone();
    for (device, d) in &mut g.account.devices {
        let label = device.label(&nvml);
        let uuid = match device {
            crate::capture::gpu::account::DeviceId::Uuid(u) => {
                format!(" ({})", crate::capture::gpu::channel::uuid_string(u))
            }
            _ => String::new(),
        };
        let busy = d.busy_ns();
        out.push_str(&format!(
            "  GPU {label}{uuid}: {} kernels, {} copies and sets; {:.3} s of device time summed over streams, busy {:.3} s; sampled launches estimate {:.3} s\n",
            d.kernels,
            d.copies,
            d.summed_ns as f64 / 1e9,
            busy as f64 / 1e9,
            d.estimated_ns / 1e9,
        ));
    }
    out.push_str(&format!(
        "  launches: {} seen, {} sampled; {} records of sampled launches, {} without their stack\n",
        st.lib_launches, st.lib_sampled, st.sampled, st.stacks_missing
    ));
    let lost = st.cupti_dropped
        + st.chunks_lost
        + st.chunks_refused
        + st.chunks_rate_limited
        + st.records_refused
        + st.notes_dropped;
    if lost > 0 || st.buffers_refused > 0 || st.kept_refused > 0 {
        out.push_str(&format!(
            "  lost: {} records CUPTI dropped ({} buffer requests refused: all buffers in use), {} chunks lost, {} refused, {} over the rate, {} records refused, {} sampled launches not queued, {} names or launches not kept\n",
            st.cupti_dropped,
            st.buffers_refused,
            st.chunks_lost,
            st.chunks_refused,
            st.chunks_rate_limited,
            st.records_refused,
            st.notes_dropped,
            st.kept_refused,
        ));
    }
    if g.account.slices_dropped > 0 {
        out.push_str(&format!(
            "  the trace holds the first {} GPU slices; {} later ones are only in the totals\n",
            g.account.slices.len(),
            g.account.slices_dropped
        ));
    }
    for (pid, s) in statuses {
        let why = match s.state {
            Some(State::SteppedAside) => format!(
                "stood aside: CUPTI is held by {}",
                s.other_tool.as_deref().unwrap_or("another tool")
            ),
            Some(State::NoCupti) => "no libcupti found (set PYROMETER_CUPTI_LIB)".to_string(),
            Some(State::CuptiError) => format!("CUPTI refused to start (error {})", s.error),
            _ => continue,
        };
        out.push_str(&format!("  pid {pid}: GPU kernels not recorded: {why}\n"));
    }
    out
}

/// The same as JSON.
pub fn json(g: &mut GpuCapture) -> serde_json::Value {
    let st = g.stats();
    let nvml: HashMap<String, u32> = g.nvml_index.clone();
    let devices: Vec<serde_json::Value> = g
        .account
        .devices
        .iter_mut()
        .map(|(device, d)| {
            serde_json::json!({
                "gpu": device.label(&nvml),
                "kernels": d.kernels,
                "copies": d.copies,
                "summed_ns": d.summed_ns,
                "busy_ns": d.busy_ns(),
                "estimated_ns": d.estimated_ns.round() as u64,
            })
        })
        .collect();
    serde_json::json!({
        "devices": devices,
        "launches": st.lib_launches,
        "sampled": st.lib_sampled,
        "records_sampled": st.sampled,
        "stacks_missing": st.stacks_missing,
        "stacks_unclaimed": st.stacks_unclaimed,
        "chunks": st.chunks,
        "chunks_lost": st.chunks_lost,
        "chunks_refused": st.chunks_refused,
        "chunks_rate_limited": st.chunks_rate_limited,
        "records_refused": st.records_refused,
        "cupti_dropped": st.cupti_dropped,
        "buffers_refused": st.buffers_refused,
        "notes_dropped": st.notes_dropped,
        "names_dropped": st.names_dropped,
        "kept_refused": st.kept_refused,
        "processes_stood_aside": st.processes_stood_aside,
        "processes_without_cupti": st.processes_without_cupti,
        "processes_cupti_error": st.processes_cupti_error,
        "slices_dropped": g.account.slices_dropped,
    })
}
