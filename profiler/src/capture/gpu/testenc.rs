//! Chunks built the way the C library builds them, for the unit tests.

use super::channel::{Api, Copy, Kernel, Launch, MAGIC, Status, VERSION};

/// Records appended one after another; `chunk` wraps them in a header.
#[derive(Default)]
pub struct Enc {
    body: Vec<u8>,
}

fn pad8(v: &mut Vec<u8>) {
    while !v.len().is_multiple_of(8) {
        v.push(0);
    }
}

impl Enc {
    fn rec(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let mut r = Vec::with_capacity(payload.len() + 8);
        r.extend_from_slice(&kind.to_le_bytes());
        r.extend_from_slice(&0u16.to_le_bytes());
        r.extend_from_slice(payload);
        pad8(&mut r);
        let len = r.len() as u16;
        r[2..4].copy_from_slice(&len.to_le_bytes());
        self.body.extend_from_slice(&r);
        self
    }

    pub fn status(&mut self, s: &Status) -> &mut Self {
        let mut p = Vec::new();
        p.extend_from_slice(&1u16.to_le_bytes()); // mode single
        p.extend_from_slice(&1u16.to_le_bytes()); // state on
        for v in [
            s.lib_version,
            s.sample_every,
            s.cupti_version,
            s.error,
            s.other,
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&u32::from(s.last).to_le_bytes());
        for v in [
            s.launches,
            s.sampled,
            s.cupti_dropped,
            s.buffers_refused,
            s.notes_dropped,
            s.names_dropped,
            s.records_unknown,
            s.dump_dropped,
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.rec(1, &p)
    }

    pub fn string(&mut self, id: u32, kind: u16, text: &str) -> &mut Self {
        let mut p = Vec::new();
        p.extend_from_slice(&id.to_le_bytes());
        p.extend_from_slice(&kind.to_le_bytes());
        p.extend_from_slice(&0u16.to_le_bytes());
        p.extend_from_slice(&(text.len() as u16).to_le_bytes());
        p.extend_from_slice(&0u16.to_le_bytes());
        p.extend_from_slice(text.as_bytes());
        self.rec(2, &p)
    }

    pub fn device(&mut self, device: u32, uuid: [u8; 16]) -> &mut Self {
        let mut p = Vec::new();
        p.extend_from_slice(&device.to_le_bytes());
        p.extend_from_slice(&uuid);
        p.extend_from_slice(&[0; 8]);
        self.rec(3, &p)
    }

    pub fn kernel(&mut self, k: &Kernel) -> &mut Self {
        let mut p = Vec::new();
        for v in [
            k.correlation,
            k.device,
            k.context,
            k.stream,
            k.name,
            k.graph,
            k.launch_type,
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&k.start.to_le_bytes());
        p.extend_from_slice(&k.end.to_le_bytes());
        for v in k.grid.iter().chain(&k.block) {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.rec(4, &p)
    }

    pub fn copy(&mut self, kind: u16, c: &Copy) -> &mut Self {
        let mut p = Vec::new();
        for v in [
            c.correlation,
            c.runtime_correlation,
            c.device,
            c.context,
            c.stream,
        ] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&[c.copy_kind, c.src_kind, c.dst_kind, c.flags]);
        p.extend_from_slice(&c.graph.to_le_bytes());
        for v in [c.bytes, c.start, c.end] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.rec(kind, &p)
    }

    pub fn launch(&mut self, l: &Launch) -> &mut Self {
        let api: u16 = match l.api {
            Api::Kernel => 1,
            Api::Cooperative => 2,
            Api::Graph => 3,
            Api::Memcpy => 4,
            Api::Memset => 5,
            Api::Other(a) => a,
        };
        let mut p = Vec::new();
        for v in [l.correlation, l.tid, l.weight] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p.extend_from_slice(&api.to_le_bytes());
        p.extend_from_slice(&[l.domain, 0]);
        p.extend_from_slice(&l.cbid.to_le_bytes());
        p.extend_from_slice(&l.nvtx.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&l.time.to_le_bytes());
        self.rec(7, &p)
    }

    pub fn alias(&mut self, from: u32, to: u32) -> &mut Self {
        let mut p = Vec::new();
        for v in [from, to, 0] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.rec(8, &p)
    }

    pub fn clock(&mut self, cupti: u64, monotonic: u64) -> &mut Self {
        let mut p = vec![0; 4];
        p.extend_from_slice(&cupti.to_le_bytes());
        p.extend_from_slice(&monotonic.to_le_bytes());
        self.rec(9, &p)
    }

    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.body.extend_from_slice(bytes);
        self
    }

    /// The records so far as one chunk with sequence number `seq`; starts a new body.
    pub fn chunk(&mut self, seq: u32) -> Vec<u8> {
        let mut c = Vec::with_capacity(16 + self.body.len());
        c.extend_from_slice(&MAGIC.to_le_bytes());
        c.extend_from_slice(&VERSION.to_le_bytes());
        c.extend_from_slice(&16u16.to_le_bytes());
        c.extend_from_slice(&seq.to_le_bytes());
        c.extend_from_slice(&((16 + self.body.len()) as u32).to_le_bytes());
        c.append(&mut self.body);
        c
    }
}

pub fn kernel(correlation: u32, name: u32, stream: u32, start: u64, end: u64) -> Kernel {
    Kernel {
        correlation,
        device: 0,
        context: 1,
        stream,
        name,
        graph: 0,
        launch_type: 0,
        start,
        end,
        grid: [1, 1, 1],
        block: [32, 1, 1],
    }
}

pub fn launch(correlation: u32, tid: u32, weight: u32, nvtx: u32) -> Launch {
    Launch {
        correlation,
        tid,
        weight,
        api: Api::Kernel,
        domain: 2,
        cbid: 211,
        nvtx,
        time: 1,
    }
}
