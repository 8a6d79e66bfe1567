//! Hostile and careless pushes, written byte by byte (so a push of a million empty samples
//! costs the test two megabytes, not a million structs): the inputs that broke the collector
//! before it checked limits, and more. Each is a whole gRPC message body: a `PushRequest`,
//! or an OTLP `ExportProfilesServiceRequest`.

// Each test binary uses part of it.
#![allow(dead_code)]

/// A protobuf message being written.
#[derive(Default, Clone)]
pub struct Pb(pub Vec<u8>);

impl Pb {
    pub fn varint(&mut self, mut v: u64) -> &mut Self {
        while v >= 0x80 {
            self.0.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
        self
    }

    /// A varint field.
    pub fn int(&mut self, field: u64, v: u64) -> &mut Self {
        self.varint(field << 3).varint(v)
    }

    /// A length-delimited field.
    pub fn bytes(&mut self, field: u64, b: &[u8]) -> &mut Self {
        self.varint(field << 3 | 2).varint(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    pub fn msg(&mut self, field: u64, m: &Pb) -> &mut Self {
        self.bytes(field, &m.0)
    }

    /// A packed repeated varint field.
    pub fn packed(&mut self, field: u64, values: impl IntoIterator<Item = u64>) -> &mut Self {
        let mut p = Pb::default();
        for v in values {
            p.varint(v);
        }
        self.bytes(field, &p.0)
    }

    /// A fixed64 field.
    pub fn fixed64(&mut self, field: u64, v: u64) -> &mut Self {
        self.varint(field << 3 | 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// A pprof profile under construction: strings interned, everything else appended.
pub struct Profile {
    pub pb: Pb,
    strings: Vec<String>,
}

impl Default for Profile {
    fn default() -> Self {
        Self::new()
    }
}

impl Profile {
    pub fn new() -> Self {
        Profile {
            pb: Pb::default(),
            strings: vec![String::new()],
        }
    }

    pub fn s(&mut self, text: &str) -> u64 {
        if let Some(i) = self.strings.iter().position(|s| s == text) {
            return i as u64;
        }
        self.strings.push(text.to_string());
        self.strings.len() as u64 - 1
    }

    /// A string appended without looking for it (for tables of millions).
    pub fn s_new(&mut self, text: String) -> u64 {
        self.strings.push(text);
        self.strings.len() as u64 - 1
    }

    pub fn sample_type(&mut self, ty: &str, unit: &str) -> &mut Self {
        let (t, u) = (self.s(ty), self.s(unit));
        let mut m = Pb::default();
        m.int(1, t).int(2, u);
        self.pb.msg(1, &m);
        self
    }

    pub fn function(&mut self, id: u64, name: &str) -> &mut Self {
        let n = self.s(name);
        let mut m = Pb::default();
        m.int(1, id).int(2, n);
        self.pb.msg(5, &m);
        self
    }

    /// A location with `lines` inlined lines of function `function`.
    pub fn location(&mut self, id: u64, function: u64, lines: usize) -> &mut Self {
        let mut m = Pb::default();
        m.int(1, id);
        let mut line = Pb::default();
        line.int(1, function).int(2, 1);
        for _ in 0..lines {
            m.msg(4, &line);
        }
        self.pb.msg(4, &m);
        self
    }

    /// A sample of `locations` (leaf first), `values` and string labels.
    pub fn sample(
        &mut self,
        locations: &[u64],
        values: &[i64],
        labels: &[(u64, u64)],
    ) -> &mut Self {
        let mut m = Pb::default();
        if !locations.is_empty() {
            m.packed(1, locations.iter().copied());
        }
        if !values.is_empty() {
            m.packed(2, values.iter().map(|&v| v as u64));
        }
        for &(k, v) in labels {
            let mut l = Pb::default();
            l.int(1, k).int(2, v);
            m.msg(3, &l);
        }
        self.pb.msg(2, &m);
        self
    }

    /// The profile's bytes: what was appended, the string table, the time.
    pub fn finish(&self, time_s: i64) -> Pb {
        let mut p = self.pb.clone();
        for s in &self.strings {
            p.bytes(6, s.as_bytes());
        }
        p.int(9, (time_s as u64).wrapping_mul(1_000_000_000));
        p
    }
}

/// A `PushRequest` of `profile`.
pub fn push(agent: &str, seq: u64, node: &str, profile: &Pb) -> Vec<u8> {
    let mut r = Pb::default();
    r.bytes(1, agent.as_bytes())
        .int(2, seq)
        .bytes(3, node.as_bytes())
        .msg(4, profile);
    r.0
}

/// One `main;work` sample of `value`, at `time_s`, for process `comm`.
pub fn simple(agent: &str, seq: u64, comm: &str, value: i64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "main").function(2, "work");
    p.location(1, 1, 1).location(2, 2, 1);
    let (k, v) = (p.s("comm"), p.s(comm));
    p.sample(&[2, 1], &[value], &[(k, v)]);
    push(agent, seq, "n1", &p.finish(time_s))
}

/// A million empty samples of a thousand empty sample types (2 MB): it once reserved a
/// billion rows before checking that counts agree.
pub fn empty_samples_many_types(time_s: i64) -> Vec<u8> {
    let mut p = Pb::default();
    for _ in 0..1000 {
        p.bytes(1, &[]);
    }
    for _ in 0..1_000_000 {
        p.bytes(2, &[]);
    }
    p.bytes(6, b"");
    p.int(9, time_s as u64 * 1_000_000_000);
    push("evil", 1, "n-evil", &p)
}

/// Empty samples within the sample limit, of one type: each has no value for it.
pub fn empty_samples(n: usize, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    for _ in 0..n {
        p.pb.bytes(2, &[]);
    }
    push("evil", 2, "n-evil", &p.finish(time_s))
}

/// One location of `lines` inlined lines, referenced `refs` times by one sample: ten
/// thousand lines and a thousand references once became a ten-million-frame stack.
pub fn inlined(lines: usize, refs: usize, seq: u64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "inlined_fn");
    p.location(1, 1, lines);
    p.sample(&vec![1; refs], &[1], &[]);
    push("evil", seq, "n-evil", &p.finish(time_s))
}

/// Many distinct samples each under the same deep location: every stack expands to the
/// depth limit, a few bytes each.
pub fn deep_distinct(samples: usize, lines: usize, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "deep_fn");
    p.location(1, 1, lines);
    for i in 0..samples as u64 {
        p.function(i + 2, &format!("leaf{i}"));
        p.location(i + 2, i + 2, 1);
        p.sample(&[i + 2, 1], &[1], &[]);
    }
    push("evil", 30, "n-evil", &p.finish(time_s))
}

/// Two samples of `i64::MAX` on one stack: their sum once wrapped to -2.
pub fn huge_values(seq: u64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "saturate_me");
    p.location(1, 1, 1);
    let (k, v) = (p.s("comm"), p.s("huge"));
    p.sample(&[1], &[i64::MAX], &[(k, v)]);
    p.sample(&[1], &[i64::MAX], &[(k, v)]);
    push("huge", seq, "n-huge", &p.finish(time_s))
}

/// `samples` samples whose `pid` label takes a new value each (cardinality).
pub fn distinct_labels(first: u64, samples: u64, seq: u64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "main");
    p.location(1, 1, 1);
    let k = p.s("pid");
    for i in first..first + samples {
        let v = p.s_new(format!("{i}"));
        p.sample(&[1], &[1], &[(k, v)]);
    }
    push("card", seq, "n-card", &p.finish(time_s))
}

/// A sample with `n` labels, or labels whose name or value is `len` bytes.
pub fn wide_labels(n: usize, len: usize, seq: u64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    p.sample_type("samples", "count");
    p.function(1, "main");
    p.location(1, 1, 1);
    let mut labels = Vec::new();
    for i in 0..n {
        let k = p.s_new(format!("k{i}{}", "k".repeat(len)));
        let v = p.s_new("v".repeat(len));
        labels.push((k, v));
    }
    p.sample(&[1], &[1], &labels);
    push("wide", seq, "n-wide", &p.finish(time_s))
}

/// A push of `n` entries in one of the counted tables: `what` is "strings", "functions",
/// "locations", "mappings" or "types".
pub fn many(what: &str, n: usize, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    if what != "types" {
        p.sample_type("samples", "count");
    }
    match what {
        "strings" => {
            for i in 0..n {
                p.s_new(format!("s{i}"));
            }
        }
        "functions" => {
            for i in 0..n as u64 {
                p.pb.msg(5, Pb::default().int(1, i + 1));
            }
        }
        "locations" => {
            for i in 0..n as u64 {
                p.pb.msg(4, Pb::default().int(1, i + 1));
            }
        }
        "mappings" => {
            for i in 0..n as u64 {
                p.pb.msg(3, Pb::default().int(1, i + 1));
            }
        }
        "types" => {
            for i in 0..n {
                p.sample_type(&format!("t{i}"), "count");
            }
        }
        other => panic!("no table {other}"),
    }
    push("many", 40, "n-many", &p.finish(time_s))
}

/// OTLP: a dictionary of `depth` locations in one stack, and `samples` samples of it, each
/// with its own thread name: the stack was once copied into every sample.
pub fn otlp_shared_stack(depth: u64, samples: u64, time_s: i64) -> Vec<u8> {
    let mut dict = Pb::default();
    dict.msg(1, &Pb::default()); // mapping 0
    dict.msg(2, &Pb::default()); // location 0
    dict.msg(3, &Pb::default()); // function 0
    let mut f = Pb::default();
    f.int(1, 1);
    dict.msg(3, &f); // function 1: "fn"
    for _ in 0..depth {
        let mut line = Pb::default();
        line.int(1, 1);
        let mut l = Pb::default();
        l.msg(3, &line);
        dict.msg(2, &l);
    }
    dict.msg(4, &Pb::default()); // link 0
    for s in ["", "fn", "samples", "count", "thread.name"] {
        dict.bytes(5, s.as_bytes());
    }
    dict.msg(6, &Pb::default()); // attribute 0
    for i in 0..samples {
        // thread.name = "t{i}", as an inline string.
        let mut value = Pb::default();
        value.bytes(1, format!("t{i}").as_bytes());
        let mut kv = Pb::default();
        kv.int(1, 4).msg(2, &value);
        dict.msg(6, &kv);
    }
    dict.msg(7, &Pb::default()); // stack 0
    let mut stack = Pb::default();
    stack.packed(1, 1..=depth);
    dict.msg(7, &stack);
    let mut profile = Pb::default();
    let mut st = Pb::default();
    st.int(1, 2).int(2, 3);
    profile.msg(1, &st);
    for i in 0..samples {
        let mut s = Pb::default();
        s.int(1, 1).packed(2, [i + 1]).packed(4, [1]);
        profile.msg(2, &s);
    }
    profile.fixed64(3, time_s as u64 * 1_000_000_000);
    otlp(&profile, &dict, "otlp-node")
}

/// OTLP: one location referenced `len` times by the stack of one sample.
pub fn otlp_long_stack(len: u64, time_s: i64) -> Vec<u8> {
    let mut dict = Pb::default();
    dict.msg(2, &Pb::default());
    dict.msg(3, &Pb::default());
    dict.msg(3, Pb::default().int(1, 1));
    let mut line = Pb::default();
    line.int(1, 1);
    dict.msg(2, Pb::default().msg(3, &line));
    for s in ["", "fn", "samples", "count"] {
        dict.bytes(5, s.as_bytes());
    }
    dict.msg(7, &Pb::default());
    dict.msg(
        7,
        Pb::default().packed(1, std::iter::repeat_n(1, len as usize)),
    );
    let mut profile = Pb::default();
    profile.msg(1, Pb::default().int(1, 2).int(2, 3));
    profile.msg(2, Pb::default().int(1, 1).packed(4, [1]));
    profile.fixed64(3, time_s as u64 * 1_000_000_000);
    otlp(&profile, &dict, "otlp-long")
}

/// OTLP: `strings` distinct strings and `samples` samples each labelled with a few of them
/// through the attribute table (label strings were once looked up one by one).
pub fn otlp_many_strings(strings: u64, samples: u64, time_s: i64) -> Vec<u8> {
    let mut dict = Pb::default();
    dict.msg(2, &Pb::default());
    dict.msg(3, &Pb::default());
    for s in ["", "samples", "count", "key"] {
        dict.bytes(5, s.as_bytes());
    }
    for i in 0..strings {
        dict.bytes(5, format!("value-{i:08}").as_bytes());
    }
    dict.msg(6, &Pb::default());
    for i in 0..samples {
        // key = string (4 + i % strings), by index.
        let mut value = Pb::default();
        value.int(8, 4 + i % strings.max(1));
        let mut kv = Pb::default();
        kv.int(1, 3).msg(2, &value);
        dict.msg(6, &kv);
    }
    dict.msg(7, &Pb::default());
    dict.msg(7, &Pb::default()); // stack 1: empty
    let mut profile = Pb::default();
    let mut st = Pb::default();
    st.int(1, 1).int(2, 2);
    profile.msg(1, &st);
    for i in 0..samples {
        let mut s = Pb::default();
        s.int(1, 1).packed(2, [i + 1]).packed(4, [1]);
        profile.msg(2, &s);
    }
    profile.fixed64(3, time_s as u64 * 1_000_000_000);
    otlp(&profile, &dict, "otlp-strings")
}

/// An OTLP request of one profile of one resource.
pub fn otlp(profile: &Pb, dict: &Pb, host: &str) -> Vec<u8> {
    let mut value = Pb::default();
    value.bytes(1, host.as_bytes());
    let mut kv = Pb::default();
    kv.bytes(1, b"host.name").msg(2, &value);
    let mut resource = Pb::default();
    resource.msg(1, &kv);
    let mut scope = Pb::default();
    scope.msg(2, profile);
    let mut rp = Pb::default();
    rp.msg(1, &resource).msg(2, &scope);
    let mut req = Pb::default();
    req.msg(1, &rp).msg(2, dict);
    req.0
}

/// A small deterministic generator for mutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `base` mutated: bytes flipped, varints inserted or removed, a part repeated, or cut.
pub fn mutate(base: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() as u64) as usize;
        match rng.below(6) {
            0 => b[at] = rng.next() as u8,
            1 => {
                let mut v = Pb::default();
                v.varint(rng.next() >> rng.below(64));
                b.splice(at..at, v.0);
            }
            2 => {
                let end = (at + 1 + rng.below(8) as usize).min(b.len());
                b.drain(at..end);
            }
            3 => {
                let end = (at + 1 + rng.below(64) as usize).min(b.len());
                let part = b[at..end].to_vec();
                for _ in 0..1 + rng.below(50) {
                    b.splice(at..at, part.iter().copied());
                }
            }
            4 => b.truncate(at.max(1)),
            _ => b[at] ^= 0x80,
        }
        if b.is_empty() {
            b.push(0);
        }
    }
    b
}
