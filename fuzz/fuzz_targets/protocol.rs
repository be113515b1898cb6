//! The plugin socket, both sides: any bytes a peer sends decode to a request (the agent's
//! side) or a response (the plugin's side), or to a clear error, never a panic; the length
//! prefix is bounded before anything is allocated; and what decodes survives a round trip
//! through the encoder the other side uses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshcap_cni::protocol::{
    MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, check_len, decode_request, decode_response, encode,
    read_frame,
};

fuzz_target!(|data: &[u8]| {
    if let Some(prefix) = data.first_chunk::<4>() {
        for max in [MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES] {
            if let Ok(len) = check_len(*prefix, max) {
                assert!(len <= max as usize, "a frame over the limit is refused");
            }
        }
    }
    if let Ok(body) = read_frame(&mut &data[..], MAX_REQUEST_BYTES) {
        assert!(body.len() <= MAX_REQUEST_BYTES as usize);
        let _ = decode_request(&body);
    }
    if let Ok(request) = decode_request(data) {
        let frame = encode(&request, u32::MAX).expect("a decoded request encodes");
        let body = read_frame(&mut frame.as_slice(), u32::MAX).expect("our own frame reads");
        assert_eq!(
            decode_request(&body).expect("our own frame decodes"),
            request
        );
    }
    if let Ok(response) = decode_response(data) {
        let frame = encode(&response, u32::MAX).expect("a decoded response encodes");
        let body = read_frame(&mut frame.as_slice(), u32::MAX).expect("our own frame reads");
        assert_eq!(
            decode_response(&body).expect("our own frame decodes"),
            response
        );
    }
});
