//! The agent's side of the socket: any bytes a peer sends must decode to a request or a clear
//! error, never a panic; decoded requests must survive a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshcap_cni::protocol::{
    MAX_REQUEST_BYTES, decode_request, decode_response, encode, read_frame,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = read_frame(&mut &data[..], MAX_REQUEST_BYTES) {
        let _ = decode_request(&body);
    }
    let _ = decode_response(data);
    if let Ok(request) = decode_request(data) {
        let frame = encode(&request, u32::MAX).expect("a decoded request encodes");
        let body = read_frame(&mut frame.as_slice(), u32::MAX).expect("our own frame reads");
        assert_eq!(decode_request(&body).expect("our own frame decodes"), request);
    }
});
