//! A request's failure on the daemon's side: a stable [`ErrorCode`] and one line of text,
//! typed until the socket, where it becomes [`Reply::Failed`].

use backstop_common::ErrorCode;

use crate::protocol::Reply;

/// Why a request failed, as the daemon answers it. The code stays an [`ErrorCode`] until the
/// reply is written; [`Reply::Failed`] carries it as its string, because a console reads codes
/// from daemons newer than itself (a code it does not know is a plain failure).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
        }
    }
}

impl From<WireError> for Reply {
    fn from(e: WireError) -> Reply {
        Reply::Failed {
            code: e.code.as_str().into(),
            message: e.message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_goes_on_the_wire_as_its_code_string() {
        let reply = Reply::from(WireError::new(ErrorCode::VmHalted, "the VM is HALTED"));
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"kind":"failed","code":"ERR_VM_HALTED","message":"the VM is HALTED"}"#
        );
    }
}
