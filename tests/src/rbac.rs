//! Kubernetes' RBAC authorizer, for the test API server: Roles, ClusterRoles and their bindings
//! read from rendered manifests (the chart's configurations, `deploy/*.yaml`: any set of YAML
//! documents), and a request's attributes decided as the API server decides them
//! (k8s.io/apiserver's request info, `plugin/pkg/auth/authorizer/rbac`): verbs, API groups,
//! resources and `resource/subresource`, resourceNames (which never authorize a create or an
//! unnamed list), RoleBindings only in their namespace, ClusterRoleBindings everywhere, and the
//! default `system:basic-user` role that lets every authenticated identity ask what it may do.
//! The bindings are read on every request, so deleting one takes effect at once.
use std::{fs, path::Path};

use serde::Deserialize as _;
use serde_json::Value;

/// What a request asks for, as the API server's request-info resolver reads its path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: String,
    /// `""` for the core group.
    pub api_group: String,
    /// `pods`, `daemonsets`, ...
    pub resource: String,
    /// `status`, `token`, ... or empty.
    pub subresource: String,
    /// The namespace (for a Namespace object itself, its name), or empty.
    pub namespace: String,
    /// The object's name; for a list or watch, the name its field selector `metadata.name=`
    /// narrows it to.
    pub name: String,
    /// A request for a path that is no resource (`/version`, `/api`).
    pub non_resource: bool,
}

impl Attributes {
    /// Reads `method` and `path?query` as the API server does.
    #[must_use]
    pub fn of(method: &str, route: &str, query: &str) -> Self {
        let parts: Vec<&str> = route.trim_matches('/').split('/').collect();
        let rest = match parts.as_slice() {
            ["api", _version, rest @ ..] => (String::new(), rest),
            ["apis", group, _version, rest @ ..] => ((*group).to_owned(), rest),
            _ => {
                return Self {
                    verb: method.to_lowercase(),
                    non_resource: true,
                    ..Self::default()
                };
            }
        };
        let (api_group, mut rest) = rest;
        if rest.is_empty() {
            return Self {
                verb: method.to_lowercase(),
                non_resource: true,
                ..Self::default()
            };
        }
        let mut namespace = String::new();
        if rest[0] == "namespaces" && rest.len() > 1 {
            namespace = rest[1].to_owned();
            // `/namespaces/NAME` and its subresources are the Namespace object itself.
            if rest.len() > 2 && !["status", "finalize"].contains(&rest[2]) {
                rest = &rest[2..];
            }
        }
        let resource = rest[0].to_owned();
        let mut name = rest.get(1).map(|s| (*s).to_owned()).unwrap_or_default();
        let subresource = rest.get(2).map(|s| (*s).to_owned()).unwrap_or_default();
        let watch = param(query, "watch").is_some_and(|w| w == "true" || w == "1");
        let verb = match method {
            "GET" | "HEAD" if name.is_empty() && watch => "watch",
            "GET" | "HEAD" if name.is_empty() => "list",
            "GET" | "HEAD" => "get",
            "POST" => "create",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" if name.is_empty() => "deletecollection",
            "DELETE" => "delete",
            other => return Self::of_unknown(other),
        }
        .to_owned();
        if matches!(verb.as_str(), "list" | "watch")
            && let Some(selected) = param(query, "fieldSelector")
                .map(|s| s.replace("%3D", "=").replace("%3d", "="))
                .and_then(|s| s.strip_prefix("metadata.name=").map(str::to_owned))
            && !selected.contains(',')
        {
            name = selected;
        }
        Self {
            verb,
            api_group,
            resource,
            subresource,
            namespace,
            name,
            non_resource: false,
        }
    }

    fn of_unknown(method: &str) -> Self {
        Self {
            verb: method.to_lowercase(),
            ..Self::default()
        }
    }

    /// `pods` or `pods/status`.
    #[must_use]
    pub fn combined_resource(&self) -> String {
        if self.subresource.is_empty() {
            self.resource.clone()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        }
    }
}

/// The query parameter `name`'s value.
#[must_use]
pub fn param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

/// The rule that allowed a request, and the verb it was used for: `(role, rule index, verb)`,
/// the role as `ClusterRole/NAME` or `Role/NAMESPACE/NAME`.
pub type Grant = (String, usize, String);

/// A ServiceAccount's user name, as the token authenticator gives it.
#[must_use]
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// The rules of the role `kind`/`name` (a Role in `namespace`) among `objects`.
fn role_rules<'a>(objects: &'a [Value], kind: &str, name: &str, namespace: &str) -> &'a [Value] {
    objects
        .iter()
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && (kind == "ClusterRole" || o["metadata"]["namespace"] == namespace)
        })
        .and_then(|o| o["rules"].as_array())
        .map_or(&[], Vec::as_slice)
}

fn listed(list: &Value, wanted: &str) -> bool {
    list.as_array()
        .is_some_and(|l| l.iter().any(|v| v == "*" || v == wanted))
}

/// Whether `rule` allows `attrs` (rbac/v1 helpers: `VerbMatches`, `APIGroupMatches`,
/// `ResourceMatches`, `ResourceNameMatches`).
fn rule_allows(rule: &Value, attrs: &Attributes) -> bool {
    if !listed(&rule["verbs"], &attrs.verb) || !listed(&rule["apiGroups"], &attrs.api_group) {
        return false;
    }
    let combined = attrs.combined_resource();
    let resource_ok = rule["resources"].as_array().is_some_and(|list| {
        list.iter().any(|r| {
            r == "*"
                || *r == combined
                || (!attrs.subresource.is_empty() && *r == format!("*/{}", attrs.subresource))
        })
    });
    if !resource_ok {
        return false;
    }
    match rule["resourceNames"].as_array() {
        None => true,
        Some(names) if names.is_empty() => true,
        Some(names) => !attrs.name.is_empty() && names.iter().any(|n| *n == attrs.name),
    }
}

fn subject_matches(subject: &Value, user: &str) -> bool {
    match subject["kind"].as_str() {
        Some("ServiceAccount") => {
            let (Some(ns), Some(name)) = (subject["namespace"].as_str(), subject["name"].as_str())
            else {
                return false;
            };
            service_account_user(ns, name) == user
        }
        Some("User") => subject["name"] == user,
        Some("Group") => {
            let ns_group = user
                .strip_prefix("system:serviceaccount:")
                .and_then(|rest| rest.split(':').next())
                .map(|ns| format!("system:serviceaccounts:{ns}"));
            matches!(
                subject["name"].as_str(),
                Some("system:authenticated" | "system:serviceaccounts")
            ) || subject["name"].as_str() == ns_group.as_deref()
        }
        _ => false,
    }
}

/// The RBAC objects the server holds: read live from `objects`.
///
/// Returns the grant that allows `attrs` for `user`, or `None` (403). Self-reviews and
/// discovery are allowed to every authenticated identity, as Kubernetes' default
/// `system:basic-user` and `system:discovery` roles do; they grant nothing from `objects`.
#[must_use]
pub fn authorize(objects: &[Value], user: &str, attrs: &Attributes) -> Option<Grant> {
    if attrs.non_resource
        || (attrs.api_group == "authorization.k8s.io"
            && attrs.verb == "create"
            && ["selfsubjectaccessreviews", "selfsubjectrulesreviews"]
                .contains(&attrs.resource.as_str()))
    {
        return Some(("system:basic-user".to_owned(), 0, attrs.verb.clone()));
    }
    for binding in objects {
        let kind = binding["kind"].as_str().unwrap_or_default();
        let binding_ns = binding["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default();
        let applies = match kind {
            "ClusterRoleBinding" => true,
            // A RoleBinding grants in its own namespace only, never cluster-scoped objects.
            "RoleBinding" => !attrs.namespace.is_empty() && attrs.namespace == binding_ns,
            _ => false,
        };
        if !applies
            || !binding["subjects"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| subject_matches(s, user)))
        {
            continue;
        }
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
        if kind == "ClusterRoleBinding" && role_kind != "ClusterRole" {
            continue;
        }
        let rules = role_rules(objects, role_kind, role_name, binding_ns);
        if let Some(index) = rules.iter().position(|r| rule_allows(r, attrs)) {
            let role = if role_kind == "ClusterRole" {
                format!("ClusterRole/{role_name}")
            } else {
                format!("Role/{binding_ns}/{role_name}")
            };
            return Some((role, index, attrs.verb.clone()));
        }
    }
    None
}

/// Every `(role, rule, verb)` the bindings give `user`: what a test expects to see used.
#[must_use]
pub fn granted(objects: &[Value], user: &str) -> Vec<Grant> {
    let mut all = Vec::new();
    for binding in objects {
        let kind = binding["kind"].as_str().unwrap_or_default();
        if !["ClusterRoleBinding", "RoleBinding"].contains(&kind)
            || !binding["subjects"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| subject_matches(s, user)))
        {
            continue;
        }
        let ns = binding["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default();
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
        let role = if role_kind == "ClusterRole" {
            format!("ClusterRole/{role_name}")
        } else {
            format!("Role/{ns}/{role_name}")
        };
        for (index, rule) in role_rules(objects, role_kind, role_name, ns)
            .iter()
            .enumerate()
        {
            for verb in rule["verbs"].as_array().into_iter().flatten() {
                let grant = (
                    role.clone(),
                    index,
                    verb.as_str().unwrap_or_default().to_owned(),
                );
                if !all.contains(&grant) {
                    all.push(grant);
                }
            }
        }
    }
    all
}

/// The objects of every YAML document in `paths` (files, or directories whose `*.yaml` files
/// are read in name order, as `kubectl apply -f DIR` reads them; not recursive).
///
/// # Panics
/// When a file cannot be read or parsed.
#[must_use]
pub fn load(paths: &[&Path]) -> Vec<Value> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut inside: Vec<_> = fs::read_dir(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .map(|e| e.expect("entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
                .collect();
            inside.sort();
            files.extend(inside);
        } else {
            files.push(path.to_path_buf());
        }
    }
    let mut objects = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let value =
                Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            if !value.is_null() {
                objects.push(value);
            }
        }
    }
    objects
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn attrs(method: &str, path: &str) -> Attributes {
        let (route, query) = path.split_once('?').unwrap_or((path, ""));
        Attributes::of(method, route, query)
    }

    #[test]
    fn request_paths_read_as_the_api_server_reads_them() {
        let a = attrs("PATCH", "/api/v1/namespaces/shop/pods/web/status");
        assert_eq!(
            (
                a.verb.as_str(),
                a.combined_resource(),
                a.namespace.as_str(),
                a.name.as_str()
            ),
            ("patch", "pods/status".to_owned(), "shop", "web")
        );
        let a = attrs(
            "GET",
            "/apis/apps/v1/namespaces/meshcap-system/daemonsets?fieldSelector=metadata.name%3Dmeshcap-agent&watch=true",
        );
        assert_eq!(
            (a.verb.as_str(), a.name.as_str()),
            ("watch", "meshcap-agent")
        );
        let a = attrs("GET", "/api/v1/namespaces/meshcap-system");
        assert_eq!(
            (a.resource.as_str(), a.namespace.as_str(), a.name.as_str()),
            ("namespaces", "meshcap-system", "meshcap-system")
        );
        let a = attrs("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1");
        assert_eq!((a.verb.as_str(), a.name.as_str()), ("list", ""));
    }

    #[test]
    fn rules_match_as_kubernetes_matches_them() {
        let objects = vec![
            json!({"kind": "Role", "metadata": {"name": "r", "namespace": "sys"},
                   "rules": [{"apiGroups": ["apps"], "resources": ["daemonsets"],
                              "resourceNames": ["agent"], "verbs": ["get", "watch"]}]}),
            json!({"kind": "RoleBinding", "metadata": {"name": "r", "namespace": "sys"},
                   "roleRef": {"kind": "Role", "name": "r"},
                   "subjects": [{"kind": "ServiceAccount", "name": "a", "namespace": "sys"}]}),
            json!({"kind": "ClusterRole", "metadata": {"name": "c"},
                   "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "c"},
                   "roleRef": {"kind": "ClusterRole", "name": "c"},
                   "subjects": [{"kind": "ServiceAccount", "name": "a", "namespace": "sys"}]}),
        ];
        let user = service_account_user("sys", "a");
        let allowed = |m, p| authorize(&objects, &user, &attrs(m, p)).is_some();
        assert!(allowed(
            "GET",
            "/apis/apps/v1/namespaces/sys/daemonsets/agent"
        ));
        assert!(!allowed(
            "GET",
            "/apis/apps/v1/namespaces/sys/daemonsets/other"
        ));
        assert!(!allowed(
            "GET",
            "/apis/apps/v1/namespaces/elsewhere/daemonsets/agent"
        ));
        assert!(allowed(
            "GET",
            "/apis/apps/v1/namespaces/sys/daemonsets?watch=1&fieldSelector=metadata.name%3Dagent"
        ));
        assert!(!allowed(
            "GET",
            "/apis/apps/v1/namespaces/sys/daemonsets?watch=1"
        ));
        assert!(allowed("GET", "/api/v1/namespaces/shop/pods/web"));
        assert!(!allowed("PATCH", "/api/v1/namespaces/shop/pods/web/status"));
        assert!(!allowed("GET", "/api/v1/namespaces/shop/pods"));
        assert!(allowed(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        ));
        let other = service_account_user("sys", "b");
        assert!(
            authorize(
                &objects,
                &other,
                &attrs("GET", "/api/v1/namespaces/x/pods/y")
            )
            .is_none()
        );
        assert_eq!(granted(&objects, &user).len(), 3);
    }
}
