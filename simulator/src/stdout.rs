//! Results go to standard output through [`print`], which returns the write error instead of
//! panicking like `print!`: `lzsim plan | head -1` closes the pipe early (`EPIPE`), and
//! `lzsim plan > /dev/full` cannot write at all (`ENOSPC`). `lzsim`'s `main` ends quietly with
//! exit code 0 on the first ([`StdoutError::is_broken_pipe`]) and reports the second.

use std::io::{self, Write};

/// Standard output could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output")]
pub struct StdoutError(#[source] pub io::Error);

impl StdoutError {
    /// The reader went away (`lzsim … | head`): nobody wants the rest, which is no error.
    pub fn is_broken_pipe(&self) -> bool {
        self.0.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Writes `text` to standard output and flushes it, so a full disk is reported here and not
/// lost when the buffer is dropped at exit.
pub fn print(text: &str) -> Result<(), StdoutError> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(StdoutError)
}

/// [`print`] with a newline after `text`.
pub fn println(text: &str) -> Result<(), StdoutError> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(StdoutError)
}

/// Whether `e` (or any error it wraps) is a closed standard output.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<StdoutError>()
            .is_some_and(StdoutError::is_broken_pipe)
    })
}
