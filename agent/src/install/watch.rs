//! Keeping meshcap installed: the primary CNI (Calico, Cilium, flannel, ...) rewrites its
//! configuration on its own restarts and upgrades, dropping meshcap's entry; a node cleanup may
//! remove the binary. The watcher re-installs on every change of the conf or bin dir, and
//! periodically in case an event was missed, on a thread of its own (the checks are blocking
//! file I/O).
use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use notify::{RecursiveMode, Watcher as _};
use tokio::sync::watch;

use super::{ConfState, InstallConfig, InstallError, Step, conflist, istio};

/// A full re-check even without events.
const RESYNC: Duration = Duration::from_secs(30);

/// Events closer together than this are handled once (a rewrite is several events).
const DEBOUNCE: Duration = Duration::from_millis(50);

/// More re-insertions than this within [`FIGHT_WINDOW`] mean another component keeps removing
/// meshcap's entry (Istio's "throttle" warning).
const FIGHT_LIMIT: usize = 5;
const FIGHT_WINDOW: Duration = Duration::from_secs(60);

/// How long after the last sign of istio-cni's agent writing against meshcap's entry
/// ([`istio::contest`]) the install stays [`InstallStatus::Contested`].
const CONTEST_WINDOW: Duration = FIGHT_WINDOW;

/// The install's state as the rest of the agent sees it (readiness, the startup taint).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstallStatus {
    /// Not checked yet.
    Starting,
    /// The configuration is in place (or we are waiting for the primary CNI's).
    Conf(ConfState),
    /// The last attempt failed; retried on the next event or resync.
    Failed(String),
    /// meshcap's entry is in place, but istio-cni's agent still runs on this node and wrote
    /// its entry against it within the last minute: why, in words ([`istio::contest`]).
    Contested(String),
}

impl std::fmt::Display for InstallStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Starting => f.write_str("not checked yet"),
            Self::Conf(state) => write!(f, "{state}"),
            Self::Failed(why) => write!(f, "failed: {why}"),
            Self::Contested(why) => write!(
                f,
                "{why}: istio-cni's agent still runs on this node; move its DaemonSet off the \
                 node (docs/install.md, \"Switching from istio-cni\")"
            ),
        }
    }
}

impl InstallStatus {
    /// Whether meshcap's entry is in place: the node may run pods.
    #[must_use]
    pub fn is_installed(&self) -> bool {
        matches!(self, Self::Conf(ConfState::Installed { .. }))
    }
}

/// What a pass of the watcher did that the coalescing status channel would lose, for counts
/// (an installation, as Istio's installer counts them, and drift put back).
#[derive(Debug, PartialEq, Eq)]
pub enum Pass<'a> {
    /// meshcap's entry is in place in `path`: `written` by this pass (`repaired`: it had been
    /// in place once and something, a primary CNI rewriting its file, took it out), or found
    /// in place by the first pass or the first after one that did not find it.
    Installed {
        /// The file holding the entry.
        path: &'a Path,
        /// Whether this pass wrote it.
        written: bool,
        /// Whether that write put back an entry something removed.
        repaired: bool,
    },
    /// The pass failed at this step.
    Failed(Step),
}

enum Message {
    Fs,
    Stop,
}

/// The running watcher. Dropping it stops the thread; the installed files stay.
pub struct Watcher {
    tx: mpsc::Sender<Message>,
    thread: Option<thread::JoinHandle<()>>,
    // Kept alive for as long as the watch should run.
    _notify: notify::RecommendedWatcher,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

/// Installs once, then keeps re-installing on changes; every outcome is published on `status`,
/// and `on_pass` is told of each installation and each failure ([`Pass`]).
///
/// # Errors
/// When the directories cannot be created or watched.
pub fn spawn(
    config: InstallConfig,
    status: watch::Sender<InstallStatus>,
    on_pass: impl Fn(&Pass<'_>) + Send + 'static,
) -> Result<Watcher, InstallError> {
    let (tx, rx) = mpsc::channel();
    let events = tx.clone();
    let mut notify = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = events.send(Message::Fs);
        }
    })
    .map_err(|source| InstallError::Watch {
        path: config.cni_conf_dir.clone(),
        source,
    })?;
    for dir in [&config.cni_conf_dir, &config.cni_bin_dir] {
        std::fs::create_dir_all(dir).map_err(|e| InstallError::io("creating", dir, e))?;
        notify
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|source| InstallError::Watch {
                path: dir.clone(),
                source,
            })?;
    }
    let thread = thread::Builder::new()
        .name("meshcap-install".to_owned())
        .spawn(move || run(&config, &rx, &status, &on_pass))
        .map_err(|e| InstallError::io("starting the watcher for", Path::new("."), e))?;
    Ok(Watcher {
        tx,
        thread: Some(thread),
        _notify: notify,
    })
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.tx.send(Message::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    config: &InstallConfig,
    rx: &mpsc::Receiver<Message>,
    status: &watch::Sender<InstallStatus>,
    on_pass: &dyn Fn(&Pass<'_>),
) {
    let mut rewrites = VecDeque::new();
    let mut installed_once = false;
    let mut last: Option<PathBuf> = None;
    let mut contested: Option<(Instant, String)> = None;
    loop {
        if let Ok(files) = conflist::read_dir(&config.cni_conf_dir)
            && let Some(why) = istio::contest(&files, last.as_deref())
        {
            tracing::warn!(
                "{why}: istio-cni's agent still runs on this node; meshcap's entry is put back"
            );
            contested = Some((Instant::now(), why));
        }
        let outcome = super::install(config);
        // A contested entry is in place too: finding it again is no new installation.
        let was_installed = matches!(
            *status.borrow(),
            InstallStatus::Conf(ConfState::Installed { .. }) | InstallStatus::Contested(_)
        );
        match &outcome {
            Ok(ConfState::Installed { written, path }) => {
                if *written || !was_installed {
                    on_pass(&Pass::Installed {
                        path,
                        written: *written,
                        repaired: *written && installed_once,
                    });
                }
                if *written {
                    note_rewrite(&mut rewrites, path);
                }
                installed_once = true;
                last = Some(path.clone());
            }
            Ok(_) => {}
            Err(failure) => on_pass(&Pass::Failed(failure.step)),
        }
        contested.take_if(|(at, _)| at.elapsed() >= CONTEST_WINDOW);
        let next = match (outcome, &contested) {
            (Ok(ConfState::Installed { .. }), Some((_, why))) => {
                InstallStatus::Contested(why.clone())
            }
            (Ok(state), _) => InstallStatus::Conf(state),
            (Err(err), _) => {
                tracing::warn!("install: {err}; retrying on the next change");
                InstallStatus::Failed(err.to_string())
            }
        };
        status.send_if_modified(|current| {
            let changed = *current != next;
            *current = next;
            changed
        });
        // A contest ends a window after its last sign: checked again then.
        let wait = contested.as_ref().map_or(RESYNC, |(at, _)| {
            RESYNC.min(CONTEST_WINDOW.saturating_sub(at.elapsed()))
        });
        match rx.recv_timeout(wait) {
            Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Ok(Message::Fs) => {
                if drain(rx) {
                    return;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

/// Waits until events stop arriving for [`DEBOUNCE`]; true when asked to stop meanwhile.
fn drain(rx: &mpsc::Receiver<Message>) -> bool {
    loop {
        match rx.recv_timeout(DEBOUNCE) {
            Ok(Message::Fs) => {}
            Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return true,
            Err(mpsc::RecvTimeoutError::Timeout) => return false,
        }
    }
}

fn note_rewrite(rewrites: &mut VecDeque<Instant>, path: &Path) {
    let now = Instant::now();
    rewrites.push_back(now);
    while rewrites
        .front()
        .is_some_and(|t| now.duration_since(*t) > FIGHT_WINDOW)
    {
        rewrites.pop_front();
    }
    if rewrites.len() > FIGHT_LIMIT {
        tracing::warn!(
            file = %path.display(),
            "re-inserted meshcap {} times in a minute: another component keeps rewriting this \
             file (with Cilium set cni.exclusive=false)",
            rewrites.len()
        );
    }
}
