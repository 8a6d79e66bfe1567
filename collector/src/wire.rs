//! A borrowed decoding of a pushed `PushRequest`: the fields ingest reads, straight from the
//! received bytes. prost's decoding builds a `String` per string-table entry and a `Vec`
//! per sample, function, location and line (thousands of small allocations a batch, about
//! 40 % of ingest's decoding); here strings borrow the buffer and every sample's location
//! ids, values and labels go to one flat list each. Field numbers and wire types are the
//! pprof spec's (see `pyrometer_proto`); unknown fields are skipped as protobuf requires,
//! repeated scalars are read packed or not, and a message field sent twice is merged, so
//! whatever prost accepts decodes here to the same values.

/// Why bytes are not a `PushRequest`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct WireError(&'static str);

fn err<T>(what: &'static str) -> Result<T, WireError> {
    Err(WireError(what))
}

/// `[start, end)` in one of [`ProfileView`]'s flat lists.
pub type Span = (u32, u32);

#[derive(Debug, Default)]
pub struct PushView<'a> {
    pub agent_id: &'a str,
    pub sequence: u64,
    pub node: &'a str,
    pub profile: Option<ProfileView<'a>>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SampleView {
    /// Into [`ProfileView::location_ids`], leaf first.
    pub location_ids: Span,
    /// Into [`ProfileView::values`].
    pub values: Span,
    /// Into [`ProfileView::labels`].
    pub labels: Span,
}

/// A label's `(key, str, num)` string indices and number.
pub type LabelView = (i64, i64, i64);

#[derive(Debug, Default, Clone, Copy)]
pub struct LocationView {
    pub id: u64,
    pub mapping_id: u64,
    pub address: u64,
    /// Into [`ProfileView::lines`]; innermost inlined function first.
    pub lines: Span,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct FunctionView {
    pub id: u64,
    pub name: i64,
    pub filename: i64,
}

#[derive(Debug, Default)]
pub struct ProfileView<'a> {
    /// `(type, unit)` string indices.
    pub sample_type: Vec<(i64, i64)>,
    pub sample: Vec<SampleView>,
    /// `(id, filename)` of each mapping.
    pub mapping: Vec<(u64, i64)>,
    pub location: Vec<LocationView>,
    pub function: Vec<FunctionView>,
    pub string_table: Vec<&'a str>,
    pub time_nanos: i64,
    pub location_ids: Vec<u64>,
    pub values: Vec<i64>,
    pub labels: Vec<LabelView>,
    /// `(function id, line, kind)` of every location's lines (kind: `Line::kind`, 0 unsaid).
    pub lines: Vec<(u64, i64, i32)>,
}

impl ProfileView<'_> {
    /// Empty, with room for exactly the counted entries.
    fn with(c: &Counts) -> Self {
        Self {
            sample_type: Vec::with_capacity(c.sample_types),
            sample: Vec::with_capacity(c.samples),
            mapping: Vec::with_capacity(c.mappings),
            location: Vec::with_capacity(c.locations),
            function: Vec::with_capacity(c.functions),
            string_table: Vec::with_capacity(c.strings),
            time_nanos: 0,
            location_ids: Vec::with_capacity(c.location_ids),
            values: Vec::with_capacity(c.values),
            labels: Vec::with_capacity(c.labels),
            lines: Vec::with_capacity(c.lines),
        }
    }

    pub fn location_ids(&self, s: &SampleView) -> &[u64] {
        &self.location_ids[s.location_ids.0 as usize..s.location_ids.1 as usize]
    }
    pub fn values(&self, s: &SampleView) -> &[i64] {
        &self.values[s.values.0 as usize..s.values.1 as usize]
    }
    pub fn labels(&self, s: &SampleView) -> &[LabelView] {
        &self.labels[s.labels.0 as usize..s.labels.1 as usize]
    }
    pub fn lines(&self, l: &LocationView) -> &[(u64, i64, i32)] {
        &self.lines[l.lines.0 as usize..l.lines.1 as usize]
    }
}

pub(crate) const VARINT: u8 = 0;
const FIXED64: u8 = 1;
pub(crate) const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// Nesting allowed in skipped groups (prost's recursion limit).
const MAX_DEPTH: u32 = 100;

pub(crate) struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self { data, at: 0 }
    }

    pub(crate) fn done(&self) -> bool {
        self.at >= self.data.len()
    }

    #[inline]
    pub(crate) fn varint(&mut self) -> Result<u64, WireError> {
        // The common one-byte case first.
        if let Some(&b) = self.data.get(self.at)
            && b < 0x80
        {
            self.at += 1;
            return Ok(u64::from(b));
        }
        let mut v = 0u64;
        for i in 0..10 {
            let Some(&b) = self.data.get(self.at) else {
                return err("truncated varint");
            };
            self.at += 1;
            if i == 9 && b > 1 {
                return err("varint overflows 64 bits");
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                return Ok(v);
            }
        }
        err("varint too long")
    }

    /// A field's number and wire type.
    pub(crate) fn key(&mut self) -> Result<(u32, u8), WireError> {
        let key = self.varint()?;
        let field = u32::try_from(key >> 3).map_err(|_| WireError("field number too large"))?;
        if field == 0 {
            return err("field number 0");
        }
        Ok((field, (key & 7) as u8))
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let len = usize::try_from(self.varint()?).map_err(|_| WireError("length too large"))?;
        let end = self.at.checked_add(len).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return err("length past the end of the message");
        };
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn str(&mut self) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes()?).map_err(|_| WireError("a string is not UTF-8"))
    }

    pub(crate) fn skip(&mut self, field: u32, wire: u8, depth: u32) -> Result<(), WireError> {
        match wire {
            VARINT => {
                self.varint()?;
            }
            FIXED64 => self.advance(8)?,
            FIXED32 => self.advance(4)?,
            LEN => {
                self.bytes()?;
            }
            START_GROUP => {
                if depth >= MAX_DEPTH {
                    return err("groups nested too deep");
                }
                loop {
                    let (f, w) = self.key()?;
                    if w == END_GROUP {
                        if f != field {
                            return err("mismatched end group");
                        }
                        break;
                    }
                    self.skip(f, w, depth + 1)?;
                }
            }
            _ => return err("invalid wire type"),
        }
        Ok(())
    }

    fn advance(&mut self, n: usize) -> Result<(), WireError> {
        if self.data.len() - self.at < n {
            return err("truncated fixed-width field");
        }
        self.at += n;
        Ok(())
    }

    /// A scalar varint field, which must have wire type 0.
    fn scalar(&mut self, wire: u8) -> Result<u64, WireError> {
        if wire != VARINT {
            return err("a varint field with another wire type");
        }
        self.varint()
    }

    pub(crate) fn message(&mut self, wire: u8) -> Result<Reader<'a>, WireError> {
        if wire != LEN {
            return err("a message field with another wire type");
        }
        Ok(Reader::new(self.bytes()?))
    }

    /// A repeated varint field, packed or not, each value given to `f`.
    fn repeated(&mut self, wire: u8, mut f: impl FnMut(u64)) -> Result<(), WireError> {
        match wire {
            VARINT => f(self.varint()?),
            LEN => {
                let mut packed = Reader::new(self.bytes()?);
                while !packed.done() {
                    f(packed.varint()?);
                }
            }
            _ => return err("a repeated varint field with another wire type"),
        }
        Ok(())
    }
}

fn span(start: usize, end: usize) -> Result<Span, WireError> {
    match (u32::try_from(start), u32::try_from(end)) {
        (Ok(s), Ok(e)) => Ok((s, e)),
        _ => err("too many entries"),
    }
}

/// How many entries each list of a push holds, read without decoding them: the limits are
/// checked on these, and the lists are then allocated once at their exact size.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub sample_types: usize,
    pub samples: usize,
    pub mappings: usize,
    pub locations: usize,
    pub functions: usize,
    pub strings: usize,
    /// Over all samples.
    pub location_ids: usize,
    pub values: usize,
    pub labels: usize,
    /// Over all locations.
    pub lines: usize,
}

/// Entries of a repeated varint field, packed or not, without decoding them.
pub(crate) fn count_repeated(r: &mut Reader<'_>, wire: u8) -> Result<usize, WireError> {
    match wire {
        VARINT => r.varint().map(|_| 1),
        // Each varint ends with the one byte of it below 0x80.
        LEN => Ok(r.bytes()?.iter().filter(|&&b| b < 0x80).count()),
        _ => err("a repeated varint field with another wire type"),
    }
}

/// Counts the lists of a `PushRequest` (see [`Counts`]); malformed framing fails here.
pub fn count(bytes: &[u8]) -> Result<Counts, WireError> {
    let mut c = Counts::default();
    let mut r = Reader::new(bytes);
    while !r.done() {
        match r.key()? {
            (4, w) => count_profile(&mut r.message(w)?, &mut c)?,
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(c)
}

fn count_profile(r: &mut Reader<'_>, c: &mut Counts) -> Result<(), WireError> {
    while !r.done() {
        match r.key()? {
            (1, w) => {
                r.message(w)?;
                c.sample_types += 1;
            }
            (2, w) => {
                let mut m = r.message(w)?;
                c.samples += 1;
                while !m.done() {
                    match m.key()? {
                        (1, w) => c.location_ids += count_repeated(&mut m, w)?,
                        (2, w) => c.values += count_repeated(&mut m, w)?,
                        (3, w) => {
                            m.message(w)?;
                            c.labels += 1;
                        }
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
            }
            (3, w) => {
                r.message(w)?;
                c.mappings += 1;
            }
            (4, w) => {
                let mut m = r.message(w)?;
                c.locations += 1;
                while !m.done() {
                    match m.key()? {
                        (4, w) => {
                            m.message(w)?;
                            c.lines += 1;
                        }
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
            }
            (5, w) => {
                r.message(w)?;
                c.functions += 1;
            }
            (6, LEN) => {
                r.bytes()?;
                c.strings += 1;
            }
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(())
}

/// Decodes a `PushRequest`, counting its lists first.
pub fn decode(bytes: &[u8]) -> Result<PushView<'_>, WireError> {
    decode_counted(bytes, &count(bytes)?)
}

/// Decodes a `PushRequest` whose lists [`count`] counted: each list is allocated once.
pub fn decode_counted<'a>(bytes: &'a [u8], c: &Counts) -> Result<PushView<'a>, WireError> {
    let mut r = Reader::new(bytes);
    let mut out = PushView::default();
    while !r.done() {
        match r.key()? {
            (1, LEN) => out.agent_id = r.str()?,
            (2, w) => out.sequence = r.scalar(w)?,
            (3, LEN) => out.node = r.str()?,
            (4, w) => {
                let mut m = r.message(w)?;
                // A message field sent twice is merged into one.
                profile(
                    &mut m,
                    out.profile.get_or_insert_with(|| ProfileView::with(c)),
                )?;
            }
            (1 | 3, _) => return err("a string field with another wire type"),
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(out)
}

fn profile<'a>(r: &mut Reader<'a>, p: &mut ProfileView<'a>) -> Result<(), WireError> {
    while !r.done() {
        match r.key()? {
            (1, w) => {
                let mut m = r.message(w)?;
                let (mut ty, mut unit) = (0, 0);
                while !m.done() {
                    match m.key()? {
                        (1, w) => ty = m.scalar(w)? as i64,
                        (2, w) => unit = m.scalar(w)? as i64,
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
                p.sample_type.push((ty, unit));
            }
            (2, w) => sample(&mut r.message(w)?, p)?,
            (3, w) => {
                let mut m = r.message(w)?;
                let (mut id, mut filename) = (0, 0);
                while !m.done() {
                    match m.key()? {
                        (1, w) => id = m.scalar(w)?,
                        (5, w) => filename = m.scalar(w)? as i64,
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
                p.mapping.push((id, filename));
            }
            (4, w) => location(&mut r.message(w)?, p)?,
            (5, w) => {
                let mut m = r.message(w)?;
                let mut f = FunctionView::default();
                while !m.done() {
                    match m.key()? {
                        (1, w) => f.id = m.scalar(w)?,
                        (2, w) => f.name = m.scalar(w)? as i64,
                        (4, w) => f.filename = m.scalar(w)? as i64,
                        (n, w) => m.skip(n, w, 0)?,
                    }
                }
                p.function.push(f);
            }
            (6, LEN) => p.string_table.push(r.str()?),
            (6, _) => return err("a string field with another wire type"),
            (9, w) => p.time_nanos = r.scalar(w)? as i64,
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(())
}

fn sample(r: &mut Reader<'_>, p: &mut ProfileView<'_>) -> Result<(), WireError> {
    // Only this sample appends to the flat lists while it is read, so each of its lists is
    // contiguous whatever order its fields arrive in.
    let (loc_start, value_start, label_start) =
        (p.location_ids.len(), p.values.len(), p.labels.len());
    while !r.done() {
        match r.key()? {
            (1, w) => r.repeated(w, |v| p.location_ids.push(v))?,
            (2, w) => r.repeated(w, |v| p.values.push(v as i64))?,
            (3, w) => {
                let mut m = r.message(w)?;
                let (mut key, mut str, mut num) = (0, 0, 0);
                while !m.done() {
                    match m.key()? {
                        (1, w) => key = m.scalar(w)? as i64,
                        (2, w) => str = m.scalar(w)? as i64,
                        (3, w) => num = m.scalar(w)? as i64,
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
                p.labels.push((key, str, num));
            }
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    p.sample.push(SampleView {
        location_ids: span(loc_start, p.location_ids.len())?,
        values: span(value_start, p.values.len())?,
        labels: span(label_start, p.labels.len())?,
    });
    Ok(())
}

fn location(r: &mut Reader<'_>, p: &mut ProfileView<'_>) -> Result<(), WireError> {
    let mut l = LocationView::default();
    let start = p.lines.len();
    while !r.done() {
        match r.key()? {
            (1, w) => l.id = r.scalar(w)?,
            (2, w) => l.mapping_id = r.scalar(w)?,
            (3, w) => l.address = r.scalar(w)?,
            (4, w) => {
                let mut m = r.message(w)?;
                let (mut function, mut line, mut kind) = (0, 0, 0);
                while !m.done() {
                    match m.key()? {
                        (1, w) => function = m.scalar(w)?,
                        (2, w) => line = m.scalar(w)? as i64,
                        (100, w) => kind = m.scalar(w)? as i32,
                        (f, w) => m.skip(f, w, 0)?,
                    }
                }
                p.lines.push((function, line, kind));
            }
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    l.lines = span(start, p.lines.len())?;
    p.location.push(l);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use pyrometer_proto::ingest::PushRequest;
    use pyrometer_proto::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};

    fn request() -> PushRequest {
        let strings = [
            "",
            "cpu",
            "nanoseconds",
            "main",
            "/bin/x",
            "größe",
            "comm",
            "x",
        ];
        PushRequest {
            agent_id: "agent-1".into(),
            sequence: u64::MAX - 3,
            node: "node-ä".into(),
            profile: Some(Profile {
                sample_type: vec![ValueType { r#type: 1, unit: 2 }],
                sample: vec![
                    Sample {
                        location_id: vec![2, 1, 300],
                        value: vec![-5],
                        label: vec![Label {
                            key: 6,
                            str: 7,
                            num: -1,
                            num_unit: 2,
                        }],
                    },
                    Sample {
                        location_id: vec![],
                        value: vec![1 << 40],
                        label: vec![],
                    },
                ],
                mapping: vec![Mapping {
                    id: 9,
                    memory_start: 1 << 50,
                    filename: 4,
                    has_functions: true,
                    ..Default::default()
                }],
                location: vec![Location {
                    id: 300,
                    mapping_id: 9,
                    address: 0xdead_beef,
                    line: vec![
                        Line {
                            function_id: 1,
                            line: 12,
                            column: 3,
                            kind: 0,
                        },
                        Line {
                            function_id: 2,
                            line: -1,
                            column: 0,
                            kind: pyrometer_proto::FrameKind::Kernel as i32,
                        },
                    ],
                    is_folded: true,
                }],
                function: vec![Function {
                    id: 1,
                    name: 3,
                    system_name: 5,
                    filename: 4,
                    start_line: 7,
                }],
                string_table: strings.map(String::from).to_vec(),
                time_nanos: 1_700_000_000_123_456_789,
                duration_nanos: 10,
                comment: vec![1, 2],
                period_type: Some(ValueType { r#type: 1, unit: 2 }),
                ..Default::default()
            }),
        }
    }

    /// Every field ingest reads comes out as prost encoded it; the rest is skipped.
    #[test]
    fn reads_what_prost_writes() {
        let bytes = request().encode_to_vec();
        let v = decode(&bytes).unwrap();
        assert_eq!(
            (v.agent_id, v.sequence, v.node),
            ("agent-1", u64::MAX - 3, "node-ä")
        );
        let p = v.profile.unwrap();
        assert_eq!(p.sample_type, [(1, 2)]);
        assert_eq!(p.string_table[5], "größe");
        assert_eq!(p.string_table.len(), 8);
        assert_eq!(p.time_nanos, 1_700_000_000_123_456_789);
        assert_eq!(p.mapping, [(9, 4)]);
        assert_eq!(p.sample.len(), 2);
        assert_eq!(p.location_ids(&p.sample[0]), [2, 1, 300]);
        assert_eq!(p.values(&p.sample[0]), [-5]);
        assert_eq!(p.labels(&p.sample[0]), [(6, 7, -1)]);
        assert_eq!(p.location_ids(&p.sample[1]), [] as [u64; 0]);
        assert_eq!(p.values(&p.sample[1]), [1 << 40]);
        let loc = p.location[0];
        assert_eq!((loc.id, loc.mapping_id, loc.address), (300, 9, 0xdead_beef));
        assert_eq!(p.lines(&loc), [(1, 12, 0), (2, -1, 2)]);
        let f = p.function[0];
        assert_eq!((f.id, f.name, f.filename), (1, 3, 4));
    }

    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
        varint(out, number << 3 | 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    /// Unpacked repeated scalars, fields out of order, unknown fields of every wire type
    /// (a group too) and a profile sent in two parts decode as prost decodes them.
    #[test]
    fn reads_other_valid_encodings_as_prost_does() {
        let mut sample = Vec::new();
        varint(&mut sample, 2 << 3); // value 7, unpacked
        varint(&mut sample, 7);
        varint(&mut sample, 1 << 3); // location id 4, unpacked
        varint(&mut sample, 4);
        field(&mut sample, 1, &[5, 6]); // location ids 5, 6, packed
        varint(&mut sample, 15 << 3 | 1); // unknown fixed64
        sample.extend_from_slice(&[0; 8]);
        varint(&mut sample, 16 << 3 | 5); // unknown fixed32
        sample.extend_from_slice(&[0; 4]);
        varint(&mut sample, 17 << 3 | 3); // unknown group holding a varint
        varint(&mut sample, 1 << 3);
        varint(&mut sample, 1);
        varint(&mut sample, 17 << 3 | 4);
        let mut first = Vec::new();
        field(&mut first, 6, b"");
        field(&mut first, 2, &sample);
        let mut second = Vec::new();
        field(&mut second, 6, b"cpu");
        let mut bytes = Vec::new();
        field(&mut bytes, 4, &first);
        field(&mut bytes, 3, b"n");
        field(&mut bytes, 4, &second);
        field(&mut bytes, 1, b"a");
        let prost = PushRequest::decode(bytes.as_slice()).unwrap();
        let v = decode(&bytes).unwrap();
        let p = v.profile.unwrap();
        let expected = prost.profile.unwrap();
        assert_eq!(p.string_table, expected.string_table);
        assert_eq!(p.location_ids(&p.sample[0]), expected.sample[0].location_id);
        assert_eq!(p.values(&p.sample[0]), expected.sample[0].value);
        assert_eq!(
            (v.agent_id, v.node),
            (prost.agent_id.as_str(), prost.node.as_str())
        );
    }

    /// Cut anywhere, a push is refused exactly when prost refuses it, and never panics.
    #[test]
    fn truncations_fail_as_with_prost() {
        let bytes = request().encode_to_vec();
        for cut in 0..bytes.len() {
            let part = &bytes[..cut];
            assert_eq!(
                decode(part).is_ok(),
                PushRequest::decode(part).is_ok(),
                "cut at {cut}"
            );
        }
        assert!(decode(&[0x0a, 0x02, 0xff, 0xfe]).is_err(), "not UTF-8");
        assert!(decode(&[0x08 | 2, 0x01]).is_err(), "a string as a varint");
        assert!(decode(&[0x00]).is_err(), "field 0");
        assert!(
            decode(&[
                0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f
            ])
            .is_err()
        );
    }
}
