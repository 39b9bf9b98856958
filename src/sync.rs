//! Synchronisation helpers shared by every layer.
//!
//! The broker guards a few fields with std `Mutex`es whose critical sections are a field
//! update, an insert or a clone, never an `.await`. A panic inside one cannot leave the data
//! half-updated, so a poisoned lock is taken as it is rather than turned into a second panic.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning (see the module comment for why that is sound here).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_usable() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
