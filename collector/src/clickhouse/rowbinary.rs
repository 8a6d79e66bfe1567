//! ClickHouse's RowBinary format, the subset the store uses: little-endian integers, strings
//! as LEB128 length + bytes, arrays as LEB128 count + elements. Every release since 1.1
//! reads and writes it the same way (unlike `RowBinaryWithNamesAndTypes`, which 18.16 lacks).

#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn len(&mut self, mut n: usize) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                self.0.push(byte);
                return;
            }
            self.0.push(byte | 0x80);
        }
    }

    pub fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    pub fn strs<S: AsRef<str>>(&mut self, v: &[S]) {
        self.len(v.len());
        for s in v {
            self.str(s.as_ref());
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unreadable ClickHouse answer: {0}")]
pub struct Malformed(pub &'static str);

pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.data.len() < n {
            return Err(Malformed("truncated row"));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    pub fn u64(&mut self) -> Result<u64, Malformed> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    pub fn i64(&mut self) -> Result<i64, Malformed> {
        Ok(self.u64()? as i64)
    }

    fn len(&mut self) -> Result<usize, Malformed> {
        let mut n = 0usize;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            n |= usize::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(n);
            }
        }
        Err(Malformed("length too long"))
    }

    pub fn str(&mut self) -> Result<String, Malformed> {
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| Malformed("a string is not UTF-8"))
    }

    pub fn strs(&mut self) -> Result<Vec<String>, Malformed> {
        let n = self.len()?;
        // Each element takes at least a byte, so a corrupt count cannot reserve much.
        let mut out = Vec::with_capacity(n.min(self.data.len()));
        for _ in 0..n {
            out.push(self.str()?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut w = Writer::default();
        w.u64(7);
        w.i64(-3);
        let long = "x".repeat(300);
        w.strs(&["a".into(), long.clone(), String::new()]);
        let mut r = Reader::new(&w.0);
        assert_eq!(r.u64().unwrap(), 7);
        assert_eq!(r.i64().unwrap(), -3);
        assert_eq!(
            r.strs().unwrap(),
            vec!["a".to_string(), long, String::new()]
        );
        assert!(r.is_empty());
        assert!(Reader::new(&w.0[..5]).u64().is_err());
    }
}
