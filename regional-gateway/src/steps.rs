//! A walk over a large structure in steps, with a yield to the requests after each: the
//! janitor's purges and the flush's look through the region view hold one lock per step, not
//! one for the whole walk (at a million keys a whole walk held a worker for milliseconds).

/// Runs `step` from `from` until it returns `None` (each call takes the cursor where the last
/// stopped and returns the next), yielding to other tasks after every step; returns how many
/// steps it took.
pub async fn in_steps<C>(from: C, mut step: impl FnMut(C) -> Option<C>) -> usize {
    let mut steps = 0;
    let mut at = Some(from);
    while let Some(cursor) = at {
        at = step(cursor);
        steps += 1;
        tokio::task::yield_now().await;
    }
    steps
}
