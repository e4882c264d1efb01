//! The children a worker starts for a run (a `bash` call, a hook, a stdio MCP server): what they
//! may take with them, and how they die.
//!
//! - [`child_env`]: a minimal environment, never the worker's: an allowlist of harmless
//!   variables (`PATH`, `LANG`, …) plus what the caller adds.
//! - [`confine`]: the child keeps no capabilities and can gain none, so even a worker running as
//!   root cannot be read through `/proc` by its children (the worker is non-dumpable, see
//!   [`crate::secrets`]).
//! - [`kill_group`]: killing a child's whole process group, by system call rather than through
//!   `/usr/bin/kill`: procps-ng 4.0's `kill -9 -PGID` parses the negative id as a signal option
//!   and, for a group id starting with 1, signals every process on the machine (`kill(-1,
//!   SIGKILL)`).

/// Variables a child may inherit from the worker: none of them holds a secret.
pub const INHERITED: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TMPDIR",
    "USER",
    "LOGNAME",
    "SHELL",
    "TERM",
    "NODE_PATH",
];

/// A child's environment: the [`INHERITED`] variables the worker had at start (never a
/// secret, whatever its name), plus `extra` (which win).
pub fn child_env(extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = INHERITED
        .iter()
        .filter(|k| !crate::secrets::is_secret(k))
        .filter_map(|k| crate::secrets::var(k).map(|v| ((*k).to_owned(), v)))
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .collect();
    env.extend(extra.iter().cloned());
    env
}

/// Makes a command's child give up every capability before it runs, and the means to regain
/// any (`no_new_privs`: setuid programs do not raise it). A root worker's child is then root
/// without `CAP_SYS_PTRACE`, and cannot read the non-dumpable worker's memory or environment.
pub fn confine(cmd: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the child between fork and exec, and makes only system calls
    // (no allocation, no locks).
    unsafe {
        cmd.pre_exec(|| {
            drop_capabilities();
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Clears the ambient, bounding, effective, permitted and inheritable capability sets. Each
/// step may fail where there is nothing to drop (an unprivileged worker): that is the goal.
unsafe fn drop_capabilities() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    // SAFETY: plain system calls on this process, with pointers to live locals.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        for cap in 0..64 {
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        let header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let data = [Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr());
    }
}

/// Sends SIGKILL to the process group `pgid` (a child spawned with `process_group(0)` leads the
/// group of its own pid). Ids that would mean "every process" (0 and 1) are refused.
pub fn kill_group(pgid: u32) -> std::io::Result<()> {
    let Ok(id) = libc::pid_t::try_from(pgid) else {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    };
    if id <= 1 {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    // SAFETY: killpg takes plain integers and touches no memory of ours.
    if unsafe { libc::killpg(id, libc::SIGKILL) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    #[tokio::test]
    async fn a_confined_child_has_no_capabilities_and_a_minimal_environment() {
        let mut cmd = tokio::process::Command::new("bash");
        cmd.args([
            "-c",
            "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; env",
        ])
        .env_clear()
        .envs(super::child_env(&[("EXTRA".into(), "1".into())]));
        super::confine(&mut cmd);
        let out = cmd.output().await.unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("CapEff:\t0000000000000000"), "{text}");
        assert!(text.contains("CapBnd:\t0000000000000000"), "{text}");
        assert!(text.contains("NoNewPrivs:\t1"), "{text}");
        assert!(text.contains("EXTRA=1"), "{text}");
        for line in text.lines().filter(|l| l.contains('=')) {
            let name = line.split('=').next().unwrap();
            assert!(
                super::INHERITED.contains(&name) || ["EXTRA", "PWD", "SHLVL", "_"].contains(&name),
                "{name} leaked into the child"
            );
        }
    }

    #[test]
    fn a_group_dies_whole_and_nonsense_ids_are_refused() {
        // A shell leading its own group, with a grandchild in it.
        let mut child = std::process::Command::new("bash")
            .args(["-c", "sleep 30 & wait"])
            .process_group(0)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        super::kill_group(child.id()).unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success());
        assert!(super::kill_group(0).is_err() && super::kill_group(1).is_err());
        assert!(super::kill_group(u32::MAX).is_err());
    }
}
