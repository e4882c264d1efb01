//! Killing a child's whole process group (a hook, a `bash` tool call, and whatever they
//! started), by system call rather than through `/usr/bin/kill`: procps-ng 4.0's `kill -9 -PGID`
//! parses the negative id as a signal option and, for a group id starting with 1, signals every
//! process on the machine (`kill(-1, SIGKILL)`).

/// Sends SIGKILL to the process group `pgid` (a child spawned with `process_group(0)` leads the
/// group of its own pid). Ids that would mean "every process" (0 and 1) are refused.
pub fn kill_group(pgid: u32) -> std::io::Result<()> {
    let Ok(id) = libc::pid_t::try_from(pgid) else { return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput)) };
    if id <= 1 {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    // SAFETY: killpg takes plain integers and touches no memory of ours.
    if unsafe { libc::killpg(id, libc::SIGKILL) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_group_dies_whole_and_nonsense_ids_are_refused() {
        // A shell leading its own group, with a grandchild in it.
        let mut child = std::process::Command::new("bash").args(["-c", "sleep 30 & wait"]).process_group(0).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        super::kill_group(child.id()).unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success());
        assert!(super::kill_group(0).is_err() && super::kill_group(1).is_err());
        assert!(super::kill_group(u32::MAX).is_err());
    }
}
