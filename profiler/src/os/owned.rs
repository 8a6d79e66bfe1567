//! Files pyrometer keeps for itself between runs (the allocation sampler's library handed to
//! processes, the kernel-symbols file): believed only when this user owns them and nobody
//! else can write them, so another user cannot put a file of their own in their place.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;

/// Owned by this user and writable by nobody else; the reason when not.
pub fn check_owner_and_mode(meta: &Metadata) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(format!(
            "owned by uid {}, not by this user ({me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "writable by group or others (mode {:o})",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_file_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            check_owner_and_mode(&std::fs::metadata(&path).unwrap()),
            Ok(())
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o664)).unwrap();
        let err = check_owner_and_mode(&std::fs::metadata(&path).unwrap()).unwrap_err();
        assert!(err.contains("mode 664"), "{err}");
    }
}
