//! `meshcap-cni`, invoked by the container runtime with CNI_COMMAND in the environment.
use std::process::ExitCode;

fn main() -> ExitCode {
    match std::env::var("CNI_COMMAND").as_deref() {
        Ok("VERSION") => {
            println!("{}", meshcap_cni::version_info());
            ExitCode::SUCCESS
        }
        other => {
            let msg = format!("unsupported CNI_COMMAND {other:?}");
            println!(
                "{}",
                serde_json::json!({ "cniVersion": "1.1.0", "code": 4, "msg": msg })
            );
            ExitCode::FAILURE
        }
    }
}
