//! The capture stream read ahead while the backend still talks to QEMU.

/// Reads the capture stream into memory while `begin_capture` still talks to QEMU after
/// `migrate`. Without it the pipe fills (1 MiB, written in about a millisecond once write
/// tracking is on), QEMU's snapshot thread blocks on it and stops serving write faults, and the
/// first device that writes guest RAM from QEMU's main loop (device restart on `cont`, a
/// virtio completion) blocks holding the big lock: `cont` or the `RESUME` never comes (seen on
/// QEMU 10: `cont` unanswered for 30 s). The caller gets the buffered bytes, then the pipe.
/// The libvirt backend, whose `cont` goes through libvirt, needs the same.
pub struct Prefetch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(std::fs::File, Vec<u8>)>,
}

impl Prefetch {
    pub fn start(mut pipe: std::fs::File) -> Prefetch {
        use std::io::Read;
        use std::os::fd::AsFd;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut chunk = vec![0u8; 1 << 20];
            while !flag.load(Ordering::Acquire) {
                let mut fds = [nix::poll::PollFd::new(
                    pipe.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(1u8)) {
                    Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                    Ok(_) => {}
                    Err(_) => break,
                }
                match pipe.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            (pipe, buf)
        });
        Prefetch { stop, thread }
    }

    /// Stops reading; returns the pipe and what was read from it.
    pub fn finish(self) -> (std::fs::File, Vec<u8>) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        match self.thread.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}
