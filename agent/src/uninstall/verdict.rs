//! Whether a stopping agent is being uninstalled: the decision table of docs/install.md
//! ("Uninstalling"), as one function of what the agent observed.
//!
//! What each signal proves:
//! - the DaemonSet read back (200) or reported gone (404) with the agent's credential is the
//!   API server's word: gone or carrying a `deletionTimestamp` is an uninstall; there with the
//!   same uid is a restart, an update, an eviction or a drain; another uid is a DaemonSet
//!   replaced, whose pods come.
//! - what the DaemonSet watch ([`super::witness`]) last delivered is the API server's word too,
//!   given while the credential worked: a watch is authorized when it starts and streams on
//!   after the ServiceAccount or the binding is deleted. Every uninstall deletes the DaemonSet
//!   (or marks it) before its pods are stopped, so the watch has usually seen it by SIGTERM.
//! - 401 proves only that this token is refused: its ServiceAccount was deleted, or its pod
//!   object was (a force deletion), or it expired. 403 proves the token is good and the rule
//!   is gone. Neither alone is an uninstall: a credential problem must never take the plugin
//!   off a node whose DaemonSet stays (pods started meanwhile would run uncaptured).
//! - both of meshcap's identities refused everything they were given (the agent's and the
//!   plugin's, whose token is bound to no pod and never expires) is: only deleting meshcap's
//!   ServiceAccounts or RBAC does that, and a node whose plugin can decide no pod could start
//!   no pod at all if the entry stayed.
//! - the API server unreachable proves nothing.
//! - a DaemonSet read back (200), not being deleted, whose `nodeSelector` or required node
//!   affinity no longer takes this node ([`super::placement`]) will never run a pod here
//!   again: not a restart, so meshcap leaves the node, as Istio's node agent does. A node that
//!   cannot be read keeps meshcap.

pub use super::placement::Placement;

/// What a fresh read of the DaemonSet with the agent's credential answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fresh {
    /// 200: the DaemonSet, with its uid, whether it carries a `deletionTimestamp`, and
    /// whether it still places a pod on this node.
    Present {
        /// Its uid (the agent's pod's owner's, or another: a new DaemonSet of that name).
        uid: String,
        /// A `deletionTimestamp` (a foreground deletion).
        deleting: bool,
        /// Its `nodeSelector` and required node affinity against this node.
        placement: Placement,
    },
    /// 404.
    Gone,
    /// 401: the agent's token is refused.
    Unauthorized,
    /// 403: the agent may no longer read its DaemonSet.
    Forbidden,
    /// No answer (connection refused, timed out, 5xx), in words.
    Unreachable(String),
}

/// What the DaemonSet watch last delivered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Witnessed {
    /// Nothing (not started, or never synced).
    Nothing,
    /// The DaemonSet with its uid and whether it carries a `deletionTimestamp`.
    Present {
        /// Its uid.
        uid: String,
        /// A `deletionTimestamp`.
        deleting: bool,
        /// The watch has streamed on since it delivered this: no refusal or failure since.
        streaming: bool,
    },
    /// A deletion, or a listing without it.
    Gone,
}

/// The agent's conclusion, and why in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// meshcap stays installed on the node.
    Stay(String),
    /// meshcap is being deleted: remove it from the node.
    Uninstall(String),
}

/// The DaemonSet could not be read and nothing seen proves a deletion: the answer depends on
/// whether meshcap's identities still have any access ([`settle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// 401 or 403, in words.
    pub what: &'static str,
}

/// The verdict from the DaemonSet `owner_uid` owning the agent's pod, a fresh read of it and
/// what the watch saw; `Err` when the agent's credential or permission was refused and nothing
/// seen settles it.
///
/// # Errors
/// [`Refused`], to be settled by what both identities may still do.
pub fn verdict(owner_uid: &str, fresh: &Fresh, seen: &Witnessed) -> Result<Verdict, Refused> {
    let present = |uid: &str, deleting: bool, how: &str| {
        if uid != owner_uid {
            Verdict::Stay(format!(
                "the DaemonSet was replaced ({how}: another uid): its new pods come"
            ))
        } else if deleting {
            Verdict::Uninstall(format!("the DaemonSet is being deleted ({how})"))
        } else {
            Verdict::Stay(format!(
                "the DaemonSet is there ({how}): a restart, an update, an eviction or a drain"
            ))
        }
    };
    match fresh {
        // Its pod never comes back here, whether it is the DaemonSet that ran this agent or a
        // new one of that name.
        Fresh::Present {
            deleting: false,
            placement: Placement::Excludes(why),
            ..
        } => {
            return Ok(Verdict::Uninstall(format!(
                "the DaemonSet is there (read now) but no longer places a pod on this node: {why}"
            )));
        }
        Fresh::Present {
            uid,
            deleting,
            placement,
        } => {
            let verdict = present(uid, *deleting, "read now");
            return Ok(match (verdict, placement) {
                (Verdict::Stay(why), Placement::Unknown(unknown)) => Verdict::Stay(format!(
                    "{why}; whether its placement still takes this node is not known \
                     ({unknown})"
                )),
                (verdict, _) => verdict,
            });
        }
        Fresh::Gone => {
            return Ok(Verdict::Uninstall(
                "the DaemonSet is gone (read now)".into(),
            ));
        }
        Fresh::Unauthorized | Fresh::Forbidden | Fresh::Unreachable(_) => {}
    }
    match seen {
        Witnessed::Gone => {
            return Ok(Verdict::Uninstall(
                "the DaemonSet's watch saw it deleted".into(),
            ));
        }
        Witnessed::Present { uid, deleting, .. } if uid != owner_uid || *deleting => {
            return Ok(present(uid, *deleting, "as its watch saw it"));
        }
        Witnessed::Present {
            streaming: true, ..
        } => {
            return Ok(Verdict::Stay(
                "the DaemonSet is there, as its watch, streaming still, delivers it: a refused \
                 credential (a token rotated, the agent's pod force-deleted), not an uninstall"
                    .into(),
            ));
        }
        Witnessed::Present { .. } | Witnessed::Nothing => {}
    }
    match fresh {
        Fresh::Unauthorized => Err(Refused {
            what: "the agent's token is refused (401)",
        }),
        Fresh::Forbidden => Err(Refused {
            what: "the agent may no longer read its DaemonSet (403)",
        }),
        Fresh::Unreachable(why) => Ok(Verdict::Stay(format!(
            "the API server cannot be asked ({why}): nothing proves an uninstall"
        ))),
        Fresh::Present { .. } | Fresh::Gone => unreachable!("answered above"),
    }
}

/// Settles a [`Refused`] verdict: `everything_lost` says that the agent and the plugin may
/// each do nothing of what they were given (each token refused, or every review denied).
#[must_use]
pub fn settle(refused: &Refused, everything_lost: bool) -> Verdict {
    if everything_lost {
        Verdict::Uninstall(format!(
            "{}, and neither the agent nor the plugin may do anything meshcap gives them: its \
             ServiceAccounts or RBAC were deleted",
            refused.what
        ))
    } else {
        Verdict::Stay(format!(
            "{}, but meshcap's other access stands: a credential or permission problem, not an \
             uninstall (the plugin decides pods while no agent runs)",
            refused.what
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn present(uid: &str, deleting: bool) -> Fresh {
        Fresh::Present {
            uid: uid.into(),
            deleting,
            placement: Placement::Takes,
        }
    }

    fn placed(uid: &str, deleting: bool, placement: Placement) -> Fresh {
        Fresh::Present {
            uid: uid.into(),
            deleting,
            placement,
        }
    }

    /// What a watch whose restart was refused last delivered.
    fn seen(uid: &str, deleting: bool) -> Witnessed {
        Witnessed::Present {
            uid: uid.into(),
            deleting,
            streaming: false,
        }
    }

    /// What a watch streaming still last delivered.
    fn streaming(uid: &str) -> Witnessed {
        Witnessed::Present {
            uid: uid.into(),
            deleting: false,
            streaming: true,
        }
    }

    fn uninstalls(v: &Result<Verdict, Refused>) -> Option<bool> {
        match v {
            Ok(Verdict::Uninstall(_)) => Some(true),
            Ok(Verdict::Stay(_)) => Some(false),
            Err(_) => None,
        }
    }

    /// docs/install.md's table, row by row.
    #[test]
    fn the_decision_table() {
        let unreachable = Fresh::Unreachable("connection refused".into());
        let rows: &[(Fresh, Witnessed, Option<bool>)] = &[
            (present("ds-1", false), Witnessed::Gone, Some(false)),
            (present("ds-2", false), Witnessed::Nothing, Some(false)),
            (present("ds-1", true), seen("ds-1", false), Some(true)),
            (Fresh::Gone, seen("ds-1", false), Some(true)),
            (Fresh::Unauthorized, Witnessed::Gone, Some(true)),
            (Fresh::Unauthorized, seen("ds-1", true), Some(true)),
            (Fresh::Unauthorized, seen("ds-2", false), Some(false)),
            (Fresh::Unauthorized, streaming("ds-1"), Some(false)),
            (Fresh::Unauthorized, seen("ds-1", false), None),
            (Fresh::Unauthorized, Witnessed::Nothing, None),
            (Fresh::Forbidden, Witnessed::Gone, Some(true)),
            (Fresh::Forbidden, streaming("ds-1"), Some(false)),
            (Fresh::Forbidden, seen("ds-1", false), None),
            (unreachable.clone(), Witnessed::Gone, Some(true)),
            (unreachable.clone(), streaming("ds-1"), Some(false)),
            (unreachable, seen("ds-1", false), Some(false)),
            (
                placed("ds-1", false, Placement::Excludes("affinity".into())),
                streaming("ds-1"),
                Some(true),
            ),
            (
                placed("ds-1", false, Placement::Unknown("node: 403".into())),
                streaming("ds-1"),
                Some(false),
            ),
            (
                placed("ds-2", false, Placement::Excludes("affinity".into())),
                Witnessed::Nothing,
                Some(true),
            ),
            (
                placed("ds-1", true, Placement::Excludes("affinity".into())),
                Witnessed::Nothing,
                Some(true),
            ),
        ];
        for (fresh, witnessed, expected) in rows {
            assert_eq!(
                uninstalls(&verdict("ds-1", fresh, witnessed)),
                *expected,
                "{fresh:?} {witnessed:?}"
            );
        }
        let refused = Refused { what: "401" };
        assert!(matches!(settle(&refused, true), Verdict::Uninstall(_)));
        assert!(matches!(settle(&refused, false), Verdict::Stay(_)));
    }
}
