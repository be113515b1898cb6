//! Empty on purpose: the programs are the `meshcap` binary; this lets the host build the crate
//! as a build-dependency of the agent (so that cargo rebuilds the agent when it changes).
#![no_std]
