//! Requests as runplane's clients send them.

/// `message` with `authorization: Bearer <token>`, the header every runplane client sends
/// (an operator, org or service token, or a run key).
pub fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}")
            .parse()
            .expect("a token is a valid header value"),
    );
    request
}

#[cfg(test)]
mod tests {
    use super::authed;

    #[test]
    fn the_token_goes_in_a_bearer_authorization_header() {
        let request = authed((), "tok-123");
        assert_eq!(
            request.metadata().get("authorization").unwrap(),
            "Bearer tok-123"
        );
    }
}
