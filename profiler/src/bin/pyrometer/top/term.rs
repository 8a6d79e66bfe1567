//! The terminal for `top`: raw input, the alternate screen and a hidden cursor while it runs,
//! and the settings it found restored however it ends — return, error, Ctrl-C or panic.
//! Plain termios and ANSI sequences (no mouse, no terminfo), so it works over ssh and in tmux.

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

/// The settings found at start, for the panic hook (which cannot reach the guard).
static SAVED: Mutex<Option<(i32, libc::termios)>> = Mutex::new(None);

const ENTER: &str = "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J";
const LEAVE: &str = "\x1b[?25h\x1b[?1049l";

/// Whether stdout is a terminal.
pub fn stdout_is_terminal() -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(libc::STDOUT_FILENO) == 1 }
}

/// Holds the terminal in `top`'s mode; dropping it puts everything back.
pub struct Terminal {
    /// stdin when it is a terminal (keys are read from it), else None: the view still runs.
    input: Option<i32>,
}

impl Terminal {
    /// Switches to the alternate screen with raw, non-echoing input.
    pub fn enter() -> std::io::Result<Terminal> {
        let fd = libc::STDIN_FILENO;
        let mut input = None;
        install_panic_hook();
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(fd) } == 1 {
            // SAFETY: a zeroed termios is a valid out-parameter for tcgetattr.
            let mut saved: libc::termios = unsafe { std::mem::zeroed() };
            // SAFETY: fd is an open terminal; saved is a valid termios.
            if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            *SAVED.lock().unwrap_or_else(|e| e.into_inner()) = Some((fd, saved));
            let mut raw = saved;
            // SAFETY: cfmakeraw edits the struct it is given.
            unsafe { libc::cfmakeraw(&mut raw) };
            // SAFETY: fd is an open terminal; raw is a valid termios.
            if unsafe { libc::tcsetattr(fd, libc::TCSAFLUSH, &raw) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            input = Some(fd);
        }
        let mut out = std::io::stdout().lock();
        out.write_all(ENTER.as_bytes())?;
        out.flush()?;
        Ok(Terminal { input })
    }

    /// Waits up to `timeout` for input and returns the keys typed (bytes), empty on timeout.
    pub fn keys(&self, timeout: Duration) -> Vec<u8> {
        let Some(fd) = self.input else {
            std::thread::sleep(timeout);
            return Vec::new();
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            return Vec::new();
        }
        let mut buf = [0u8; 64];
        // SAFETY: reads into a buffer of the length given.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        buf[..usize::try_from(n).unwrap_or(0)].to_vec()
    }

    /// Rows and columns, or 24×80 when the terminal does not say.
    pub fn size(&self) -> (usize, usize) {
        // SAFETY: a zeroed winsize is a valid out-parameter.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes a winsize.
        let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
        if ok && ws.ws_row > 0 && ws.ws_col > 0 {
            (usize::from(ws.ws_row), usize::from(ws.ws_col))
        } else {
            (24, 80)
        }
    }

    /// Draws `lines` from the top left, each cut to `cols`, clearing what was below.
    pub fn draw(&self, lines: &[String], cols: usize) -> std::io::Result<()> {
        let mut frame = String::from("\x1b[H");
        for (i, line) in lines.iter().enumerate() {
            if i > 0 {
                frame.push_str("\r\n");
            }
            frame.extend(line.chars().take(cols));
            frame.push_str("\x1b[K");
        }
        frame.push_str("\x1b[J");
        let mut out = std::io::stdout().lock();
        out.write_all(frame.as_bytes())?;
        out.flush()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        restore();
    }
}

/// Leaves the alternate screen, shows the cursor and puts the saved settings back; safe to
/// call more than once.
fn restore() {
    let mut out = std::io::stdout();
    let _ = out.write_all(LEAVE.as_bytes());
    let _ = out.flush();
    if let Some((fd, saved)) = SAVED.lock().unwrap_or_else(|e| e.into_inner()).take() {
        // SAFETY: fd was a terminal at start; saved is what tcgetattr returned.
        unsafe { libc::tcsetattr(fd, libc::TCSAFLUSH, &saved) };
    }
}

/// A panic restores the terminal before its message is printed (on the alternate screen the
/// message would vanish with it).
fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore();
        previous(info);
    }));
}
