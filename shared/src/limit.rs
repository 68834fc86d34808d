//! One limit of a request: the window key, its limit and this request's cost. The request path
//! (`request`), the table (`table`) and the wire types (`wire`) all take it, so it lives apart
//! from each of them (none of the three imports another for it).

use crate::identity::WindowKeyRef;

/// One limit of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitRequest<'a> {
    /// Which window key.
    pub key: WindowKeyRef<'a>,
    /// Allowed cost per window.
    pub limit: u64,
    /// This request's cost.
    pub cost: u64,
}
