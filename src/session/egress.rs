//! What the egress proxy reports about a session's kernel (a request allowed or refused, a
//! connection's end) reaches the recording as the rest of the session's story does: as a
//! [`LifecycleEvent`] reported through the registry's [`super::Recorder`].

use uuid::Uuid;

use super::lifecycle::LifecycleEvent;
use super::registry::Registry;
use crate::egress::{EgressEvent, EgressObserver};

impl EgressObserver for Registry {
    fn report(&self, session: Uuid, user: &str, event: EgressEvent) {
        // A session already gone (its kernel's last connection closing) has nothing to
        // record into.
        let Ok(s) = self.get(user, session) else {
            return;
        };
        Registry::report(self, &s, &LifecycleEvent::from(event));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::fake_sandbox::user;
    use crate::session::testing::{config, FakeSandbox, TestRecorder};
    use crate::session::CreateOptions;

    /// A report reaches the registry's recorder as a lifecycle event of the session, and
    /// only when the session is live and its user's.
    #[tokio::test(start_paused = true)]
    async fn the_proxys_reports_are_recorded_as_the_sessions_events() {
        let recorder = TestRecorder::new();
        let registry = Registry::new(
            FakeSandbox::new(),
            config(),
            vec!["script".into()],
            recorder.clone(),
        );
        let s = registry
            .create(&user("alice"), 5, CreateOptions::default())
            .await
            .unwrap();
        let refused = EgressEvent::Refused {
            method: "GET".into(),
            host: "example.org".into(),
            port: 80,
            reason: "host not allowed by policy: example.org".into(),
        };
        let closed = EgressEvent::Closed {
            host: "pypi.org".into(),
            port: 443,
            bytes_sent: 10,
            bytes_received: 20,
            seconds: 0.5,
        };
        EgressObserver::report(&registry, s.id, "bob", refused.clone());
        EgressObserver::report(&registry, Uuid::new_v4(), "alice", refused.clone());
        EgressObserver::report(&registry, s.id, "alice", refused.clone());
        EgressObserver::report(&registry, s.id, "alice", closed.clone());
        let egress: Vec<_> = recorder
            .events()
            .into_iter()
            .filter(|e| {
                matches!(
                    e,
                    LifecycleEvent::EgressAllowed { .. }
                        | LifecycleEvent::EgressRefused { .. }
                        | LifecycleEvent::EgressClosed { .. }
                )
            })
            .collect();
        assert_eq!(
            egress,
            [LifecycleEvent::from(refused), LifecycleEvent::from(closed)]
        );
        registry.shutdown().await;
    }
}
