-- A sync reads what was written after what it saw, whatever a flush's commit delay: each flush
-- stamps its rows with a number from `ratelimit_stamp` (one counter for the table), taken after
-- the flush registered, in `ratelimit_flushers`, the counter's value before it (`low`); the
-- flush's commit deletes that row. A sync reads the rows stamped after its cursor and moves the
-- cursor to the counter's value, but never past a registered `low`: a flush still in flight
-- holds every reader below its stamp until it commits or rolls back. `since` (the database's
-- clock) lets a gateway delete the registration of a flusher that died; a flush whose
-- registration was deleted rolls back.
ALTER TABLE ratelimit_window_counts ADD COLUMN stamp BIGINT UNSIGNED NOT NULL DEFAULT 0;
CREATE INDEX ratelimit_window_counts_stamp_idx ON ratelimit_window_counts (stamp);
DROP INDEX ratelimit_window_counts_updated_idx ON ratelimit_window_counts;
CREATE TABLE ratelimit_stamp (
    id TINYINT UNSIGNED NOT NULL PRIMARY KEY,
    v BIGINT UNSIGNED NOT NULL
);
INSERT INTO ratelimit_stamp (id, v) VALUES (1, 0);
CREATE TABLE ratelimit_flushers (
    flusher VARBINARY(128) NOT NULL PRIMARY KEY,
    low BIGINT UNSIGNED NOT NULL,
    since BIGINT UNSIGNED NOT NULL
);
