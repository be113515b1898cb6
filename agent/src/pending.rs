//! Live enrollments still to be done ([`crate::enrollment`]): a running pod that should be in
//! ambient mode and whose enrollment failed — no ztunnel connected yet (as after a switch from
//! istio-cni, while ztunnel reconnects), its network namespace not found yet, a transient
//! error — is tried again, with backoff, until it is enrolled or should not be any more, as
//! Istio's node agent requeues a pod its informer could not reconcile (`informers.go`, the
//! rate-limited queue). A ztunnel connecting makes every pending pod due at once. Each pod's
//! attempts and last error are counted (`meshcap_enrollment_retries_total`,
//! `meshcap_enrollment_pending`) and shown by `explain`.
use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use futures::Stream;
use meshcap_policy::PodName;
use serde::{Deserialize, Serialize};

/// The first wait after a failed attempt; it doubles with each further failure.
const FIRST_WAIT: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
const LONGEST_WAIT: Duration = Duration::from_secs(30);
/// How often the controller looks for pods that are due.
const TICK: Duration = Duration::from_secs(1);

/// A pod's pending enrollment, as `explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingEnrollment {
    /// Attempts that failed so far.
    pub attempts: u32,
    /// Why the last one failed.
    pub last_error: String,
    /// Seconds until the next attempt (sooner when a ztunnel connects).
    pub next_attempt_in_seconds: u64,
}

struct Entry {
    pod: PodName,
    attempts: u32,
    error: String,
    next: Instant,
    /// The ztunnels greeted when it last failed.
    ztunnels: u64,
}

/// The pending enrollments, by pod uid.
#[derive(Default)]
pub struct Pending(Mutex<HashMap<String, Entry>>);

impl Pending {
    /// Records a failed attempt to enroll `pod` (`ztunnels`: how many ztunnels ambient mode had
    /// greeted then); its number.
    pub fn failed(&self, uid: &str, pod: PodName, error: String, ztunnels: u64) -> u32 {
        let mut entries = self.entries();
        let entry = entries.entry(uid.to_owned()).or_insert_with(|| Entry {
            pod: pod.clone(),
            attempts: 0,
            error: String::new(),
            next: Instant::now(),
            ztunnels,
        });
        entry.attempts += 1;
        let wait = FIRST_WAIT
            .saturating_mul(1 << (entry.attempts - 1).min(5))
            .min(LONGEST_WAIT);
        entry.pod = pod;
        entry.error = error;
        entry.next = Instant::now() + wait;
        entry.ztunnels = ztunnels;
        entry.attempts
    }

    /// Forgets `uid`'s pending enrollment (enrolled, or not to be); whether there was one.
    pub fn done(&self, uid: &str) -> bool {
        self.entries().remove(uid).is_some()
    }

    /// The pods due for another attempt: their wait is over, or a ztunnel was greeted since
    /// they failed (`ztunnels` now).
    #[must_use]
    pub fn due(&self, ztunnels: u64) -> Vec<String> {
        let now = Instant::now();
        self.entries()
            .iter()
            .filter(|(_, e)| e.next <= now || e.ztunnels != ztunnels)
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// `pod`'s pending enrollment, if any.
    #[must_use]
    pub fn of(&self, pod: &PodName) -> Option<PendingEnrollment> {
        let now = Instant::now();
        self.entries()
            .values()
            .find(|e| e.pod == *pod)
            .map(|e| PendingEnrollment {
                attempts: e.attempts,
                last_error: e.error.clone(),
                next_attempt_in_seconds: e.next.saturating_duration_since(now).as_secs(),
            })
    }

    /// How many pods are pending.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    /// Whether none is.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A tick every second, on which the controller looks for pods that are due.
pub fn ticks() -> impl Stream<Item = ()> {
    futures::stream::unfold((), |()| async {
        tokio::time::sleep(TICK).await;
        Some(((), ()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> PodName {
        PodName {
            namespace: "shop".to_owned(),
            name: "web".to_owned(),
        }
    }

    #[test]
    fn a_failed_pod_waits_longer_each_time_and_a_new_ztunnel_makes_it_due() {
        let pending = Pending::default();
        assert_eq!(
            pending.failed("uid-web", web(), "no ztunnel".to_owned(), 0),
            1
        );
        assert!(pending.due(0).is_empty(), "waits a second first");
        assert_eq!(pending.due(1), ["uid-web"], "a ztunnel connected meanwhile");
        assert_eq!(pending.failed("uid-web", web(), "again".to_owned(), 1), 2);
        let shown = pending.of(&web()).expect("pending");
        assert_eq!(shown.attempts, 2);
        assert_eq!(shown.last_error, "again");
        assert!(shown.next_attempt_in_seconds <= 2);
        for _ in 0..10 {
            pending.failed("uid-web", web(), "still".to_owned(), 1);
        }
        assert!(pending.of(&web()).expect("pending").next_attempt_in_seconds <= 30);
        assert!(pending.done("uid-web"));
        assert!(pending.is_empty());
        assert!(!pending.done("uid-web"));
    }
}
