//! One watch of the node's pods for every controller that follows them: the pod source's own
//! store, the repair controller and live enrollment are fed from the same watch, as Istio's
//! node agent shares one pod informer (`cni/pkg/nodeagent/informers.go`). On the API server a
//! node then holds one pod watch, not one per controller.
//!
//! A subscriber is sent every pod the watch holds when it subscribes (as `InitApply`), then
//! every change the watch delivers, in order, on a channel of its own: a slow controller holds
//! up nobody, and loses nothing. A change may reach a subscriber twice (in the replay and
//! live), never not at all; every controller's handling is idempotent.
//!
//! The adoptions at start read the node's pods from the same watch's first list
//! ([`PodFeed::listed`]) rather than listing them again: a node's start lists its pods once.
use std::{
    collections::{BTreeMap, BTreeSet},
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
};

use futures::Stream;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;
use tokio::sync::{mpsc, watch};

/// A pod's namespace and name.
type Key = (String, String);

fn key(pod: &Pod) -> Key {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// The fan-out: what the watch holds, and the subscribers.
#[derive(Clone, Debug)]
pub struct PodFeed {
    inner: Arc<Mutex<Inner>>,
    first: Arc<watch::Sender<FirstList>>,
}

/// Where the watch's first list is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum FirstList {
    Pending,
    Complete,
    /// The watch failed before it: why, last.
    Failed(String),
}

impl Default for PodFeed {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            first: Arc::new(watch::Sender::new(FirstList::Pending)),
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Every pod the watch holds.
    known: BTreeMap<Key, Pod>,
    /// During a (re)list: the pods it listed so far.
    listing: Option<BTreeSet<Key>>,
    subscribers: Vec<mpsc::UnboundedSender<Event<Pod>>>,
}

impl PodFeed {
    /// Passes one event of the watch on to every subscriber (those gone are dropped).
    pub(super) fn send(&self, event: &Event<Pod>) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Init => inner.listing = Some(BTreeSet::new()),
            Event::InitApply(pod) => {
                let key = key(pod);
                if let Some(listing) = &mut inner.listing {
                    listing.insert(key.clone());
                }
                inner.known.insert(key, pod.clone());
            }
            Event::InitDone => {
                // A relist: the pods it did not list went while the watch was down.
                if let Some(listed) = inner.listing.take() {
                    inner.known.retain(|key, _| listed.contains(key));
                }
                self.first.send_replace(FirstList::Complete);
            }
            Event::Apply(pod) => {
                inner.known.insert(key(pod), pod.clone());
            }
            Event::Delete(pod) => {
                inner.known.remove(&key(pod));
            }
        }
        inner
            .subscribers
            .retain(|subscriber| subscriber.send(event.clone()).is_ok());
    }

    /// The node's pods from now on: every pod the watch holds, then every change.
    #[must_use]
    pub fn subscribe(&self) -> PodEvents {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        for pod in inner.known.values() {
            // The receiver is right here: the send cannot fail.
            let _ = tx.send(Event::InitApply(pod.clone()));
        }
        inner.subscribers.push(tx);
        PodEvents(rx)
    }

    /// Records that the watch failed (it retries on its own); only an answer to
    /// [`Self::listed`] while its first list is not complete.
    pub(super) fn failed(&self, error: &str) {
        self.first.send_if_modified(|first| {
            if *first == FirstList::Complete {
                return false;
            }
            *first = FirstList::Failed(error.to_owned());
            true
        });
    }

    /// Every pod the watch holds, once its first list is complete (at once after that).
    ///
    /// # Errors
    /// Why the watch failed, when it failed before its first list was complete.
    pub async fn listed(&self) -> Result<Vec<Pod>, String> {
        let first = match self
            .first
            .subscribe()
            .wait_for(|first| *first != FirstList::Pending)
            .await
        {
            Ok(first) => first.clone(),
            // The sender lives as long as `self`.
            Err(_) => FirstList::Pending,
        };
        match first {
            FirstList::Complete => {
                let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(inner.known.values().cloned().collect())
            }
            FirstList::Failed(error) => Err(error),
            FirstList::Pending => Err("the pod watch ended".to_owned()),
        }
    }
}

/// A subscriber's events ([`PodFeed::subscribe`]).
#[derive(Debug)]
pub struct PodEvents(mpsc::UnboundedReceiver<Event<Pod>>);

impl Stream for PodEvents {
    type Item = Event<Pod>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use futures::{FutureExt as _, StreamExt as _};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod(name: &str, version: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("shop".into()),
                name: Some(name.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    /// What `events` holds now, as (kind, name, version).
    fn drain(events: &mut PodEvents) -> Vec<(&'static str, String, String)> {
        let mut out = Vec::new();
        while let Some(Some(event)) = events.next().now_or_never() {
            let (kind, pod) = match event {
                Event::InitApply(pod) => ("init", pod),
                Event::Apply(pod) => ("apply", pod),
                Event::Delete(pod) => ("delete", pod),
                Event::Init | Event::InitDone => continue,
            };
            out.push((
                kind,
                pod.metadata.name.unwrap_or_default(),
                pod.metadata.resource_version.unwrap_or_default(),
            ));
        }
        out
    }

    #[test]
    fn a_late_subscriber_is_sent_what_the_watch_holds_then_every_change() {
        let feed = PodFeed::default();
        let mut early = feed.subscribe();
        feed.send(&Event::Init);
        feed.send(&Event::InitApply(pod("a", "1")));
        feed.send(&Event::InitApply(pod("b", "1")));
        feed.send(&Event::InitDone);
        feed.send(&Event::Apply(pod("a", "2")));
        feed.send(&Event::Delete(pod("b", "1")));
        let mut late = feed.subscribe();
        feed.send(&Event::Apply(pod("c", "1")));
        let s = |x: &str| x.to_owned();
        assert_eq!(
            drain(&mut early),
            vec![
                ("init", s("a"), s("1")),
                ("init", s("b"), s("1")),
                ("apply", s("a"), s("2")),
                ("delete", s("b"), s("1")),
                ("apply", s("c"), s("1")),
            ]
        );
        assert_eq!(
            drain(&mut late),
            vec![("init", s("a"), s("2")), ("apply", s("c"), s("1"))]
        );
    }

    #[test]
    fn a_relist_forgets_the_pods_it_no_longer_lists() {
        let feed = PodFeed::default();
        feed.send(&Event::Init);
        feed.send(&Event::InitApply(pod("a", "1")));
        feed.send(&Event::InitApply(pod("b", "1")));
        feed.send(&Event::InitDone);
        // The watch went down; b was deleted meanwhile.
        feed.send(&Event::Init);
        feed.send(&Event::InitApply(pod("a", "3")));
        feed.send(&Event::InitDone);
        let mut late = feed.subscribe();
        assert_eq!(
            drain(&mut late),
            vec![("init", "a".to_owned(), "3".to_owned())]
        );
    }

    #[tokio::test]
    async fn the_pods_listed_are_given_once_the_first_list_is_complete() {
        let feed = PodFeed::default();
        let waiting = tokio::spawn({
            let feed = feed.clone();
            async move { feed.listed().await }
        });
        feed.send(&Event::Init);
        feed.send(&Event::InitApply(pod("a", "1")));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "given before the list was complete");
        feed.send(&Event::InitApply(pod("b", "1")));
        feed.send(&Event::InitDone);
        let names = |pods: Vec<Pod>| -> Vec<String> {
            pods.into_iter()
                .map(|p| p.metadata.name.unwrap_or_default())
                .collect()
        };
        assert_eq!(
            names(waiting.await.expect("joined").expect("listed")),
            ["a", "b"]
        );
        feed.send(&Event::Delete(pod("a", "1")));
        feed.failed("a later error is the watch's to retry");
        assert_eq!(names(feed.listed().await.expect("listed")), ["b"]);
    }

    #[tokio::test]
    async fn a_watch_that_fails_before_its_first_list_is_an_error() {
        let feed = PodFeed::default();
        feed.failed("pods is forbidden");
        assert_eq!(feed.listed().await, Err("pods is forbidden".to_owned()));
        feed.send(&Event::Init);
        feed.send(&Event::InitApply(pod("a", "1")));
        feed.send(&Event::InitDone);
        assert_eq!(feed.listed().await.expect("listed").len(), 1);
    }

    #[test]
    fn a_subscriber_gone_is_dropped() {
        let feed = PodFeed::default();
        drop(feed.subscribe());
        let mut kept = feed.subscribe();
        feed.send(&Event::Apply(pod("a", "1")));
        assert_eq!(drain(&mut kept).len(), 1);
        let inner = feed.inner.lock().expect("lock");
        assert_eq!(inner.subscribers.len(), 1);
    }
}
