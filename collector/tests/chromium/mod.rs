//! Headless Chromium driven over the DevTools protocol through `--remote-debugging-pipe`
//! (NUL-terminated JSON on file descriptors 3 and 4), so a test can click and read the DOM
//! without a websocket client or a Node/puppeteer install.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub const CHROMIUM: &str = "/usr/bin/chromium";

/// How long one protocol command may take before the test gives up on the browser.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running browser with one attached page; killed when dropped, so a failing assertion
/// does not leave it behind.
pub struct Chromium {
    child: Child,
    to_browser: File,
    from_browser: Receiver<Value>,
    next_id: u64,
    session: String,
}

fn pipe() -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    (fds[0], fds[1])
}

impl Chromium {
    /// Opens `url` in a `width`×`height` window, with its profile under `dir`.
    pub fn launch(url: &str, dir: &Path, width: u32, height: u32) -> Chromium {
        assert!(
            Path::new(CHROMIUM).exists(),
            "{CHROMIUM} is needed: run `cargo xtask deps`"
        );
        let (browser_reads, we_write) = pipe();
        let (we_read, browser_writes) = pipe();
        let mut cmd = Command::new(CHROMIUM);
        cmd.args([
            "--headless",
            // Root cannot use Chromium's sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
        ])
        .arg(format!("--window-size={width},{height}"))
        .arg(format!(
            "--user-data-dir={}",
            dir.join("chromium").display()
        ))
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls between fork and exec. The descriptors are
        // first copied above 10, so dup2 onto 3 and 4 cannot clobber one with the other.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::fcntl(browser_reads, libc::F_DUPFD, 10);
                let w = libc::fcntl(browser_writes, libc::F_DUPFD, 10);
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start chromium");
        // SAFETY: each descriptor came from pipe2 above and is closed or owned exactly once;
        // the browser's ends live on in the child only.
        let (to_browser, from) = unsafe {
            libc::close(browser_reads);
            libc::close(browser_writes);
            (File::from_raw_fd(we_write), File::from_raw_fd(we_read))
        };
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(from);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        buf.pop();
                        if let Ok(v) = serde_json::from_slice::<Value>(&buf)
                            && tx.send(v).is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        let mut c = Chromium {
            child,
            to_browser,
            from_browser: rx,
            next_id: 0,
            session: String::new(),
        };
        let deadline = Instant::now() + REPLY_TIMEOUT;
        let target = loop {
            let targets = c.call("Target.getTargets", json!({}), false);
            if let Some(t) = targets["targetInfos"]
                .as_array()
                .and_then(|ts| ts.iter().find(|t| t["type"] == "page"))
            {
                break t["targetId"].clone();
            }
            assert!(Instant::now() < deadline, "chromium opened no page");
            std::thread::sleep(Duration::from_millis(100));
        };
        let attached = c.call(
            "Target.attachToTarget",
            json!({ "targetId": target, "flatten": true }),
            false,
        );
        c.session = attached["sessionId"]
            .as_str()
            .expect("a session id")
            .to_string();
        // The window size leaves the viewport a little smaller; the page is laid out (and
        // screenshots taken) at exactly width×height.
        c.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
            true,
        );
        c
    }

    /// Loads `url` in the page; returns once the new document has replaced the old one (the
    /// page's scripts may still be loading).
    pub fn navigate(&mut self, url: &str) {
        let r = self.call("Page.navigate", json!({ "url": url }), true);
        assert!(r["errorText"].is_null(), "navigate to {url}: {r}");
        let deadline = Instant::now() + REPLY_TIMEOUT;
        while self.eval("document.readyState") != "complete" {
            assert!(Instant::now() < deadline, "{url} did not load");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Real mouse input at viewport coordinates, as a user's pointer gives it (the page sees
    /// trusted events): `kind` is mouseMoved, mousePressed or mouseReleased.
    fn mouse(&mut self, kind: &str, x: f64, y: f64, pressed: bool) {
        let button = if pressed || kind != "mouseMoved" {
            "left"
        } else {
            "none"
        };
        self.call(
            "Input.dispatchMouseEvent",
            json!({ "type": kind, "x": x, "y": y, "button": button,
                    "buttons": if pressed { 1 } else { 0 }, "clickCount": 1 }),
            true,
        );
    }

    /// Moves the pointer to (x, y), as hovering does.
    pub fn hover(&mut self, x: f64, y: f64) {
        self.mouse("mouseMoved", x, y, false);
    }

    pub fn click_at(&mut self, x: f64, y: f64) {
        self.mouse("mouseMoved", x, y, false);
        self.mouse("mousePressed", x, y, true);
        self.mouse("mouseReleased", x, y, false);
    }

    /// Presses the left button at `from`, moves in steps to `to` and releases there.
    pub fn drag(&mut self, from: (f64, f64), to: (f64, f64)) {
        self.mouse("mouseMoved", from.0, from.1, false);
        self.mouse("mousePressed", from.0, from.1, true);
        for i in 1..=10 {
            let t = f64::from(i) / 10.0;
            let x = from.0 + (to.0 - from.0) * t;
            let y = from.1 + (to.1 - from.1) * t;
            self.mouse("mouseMoved", x, y, true);
        }
        self.mouse("mouseReleased", to.0, to.1, false);
    }

    /// Sends one command (to the page's session, or to the browser) and returns its result.
    fn call(&mut self, method: &str, params: Value, to_page: bool) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if to_page {
            msg["sessionId"] = self.session.clone().into();
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.to_browser
            .write_all(&bytes)
            .unwrap_or_else(|e| panic!("chromium went away: {e}"));
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.from_browser.recv_timeout(left) {
                // Events (no id) and replies to other commands are not ours to wait for.
                Ok(v) if v["id"] == id => {
                    assert!(v["error"].is_null(), "{method}: {}", v["error"]);
                    return v["result"].clone();
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("{method}: no reply in time"),
                Err(RecvTimeoutError::Disconnected) => panic!("{method}: chromium exited"),
            }
        }
    }

    /// Types `text` into the focused element, as a keyboard would insert it.
    #[allow(dead_code)]
    pub fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({ "text": text }), true);
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    pub fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            true,
        );
        assert!(
            r["exceptionDetails"].is_null(),
            "{expression}: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Polls `expression` until it is truthy (returning its value); fails naming `what`.
    pub fn wait_for(&mut self, what: &str, expression: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = self.eval(expression);
            if !(v.is_null() || v == false || v == "" || v == 0) {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Opens the web UI's capture panel once its script is up, and waits until `filled` (a
    /// JavaScript expression) is true: the panel holds what the page's query gave it.
    #[allow(dead_code)] // the collector's own page tests have no capture panel to open
    pub fn open_capture_panel(&mut self, what: &str, filled: &str) {
        self.wait_for(
            "the capture panel's script",
            r#"(typeof capFlame !== "undefined" && capFlame) ? true : null"#,
        );
        self.eval(r#"document.getElementById("capture-open").click()"#);
        self.wait_for(what, filled);
    }

    /// Writes a PNG of the page as it is drawn now.
    pub fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({ "format": "png" }), true);
        let png = base64_decode(r["data"].as_str().expect("screenshot data"));
        std::fs::write(path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let digits: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &c)| acc | value(c) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[test]
fn base64_round_trip() {
    assert_eq!(base64_decode("aGVsbG8="), b"hello");
    assert_eq!(base64_decode("aGk="), b"hi");
    assert_eq!(base64_decode("YWJj"), b"abc");
}
