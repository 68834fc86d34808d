-- A sync reads what was written after what it saw: each flush stamps its rows with a number
-- from `ratelimit_stamp` (one counter for the table), taken inside the flush's write
-- transaction. SQLite runs one write transaction at a time, so stamps are in commit order and
-- a sync moves its cursor to the counter's value. `ratelimit_flushers` is MySQL's registry of
-- flushes in flight, kept here so that one sync statement serves both (it stays empty).
ALTER TABLE ratelimit_window_counts ADD COLUMN stamp INTEGER NOT NULL DEFAULT 0;
CREATE INDEX ratelimit_window_counts_stamp_idx ON ratelimit_window_counts (stamp);
DROP INDEX ratelimit_window_counts_updated_idx;
CREATE TABLE ratelimit_stamp (
    id INTEGER NOT NULL PRIMARY KEY,
    v INTEGER NOT NULL
);
INSERT INTO ratelimit_stamp (id, v) VALUES (1, 0);
CREATE TABLE ratelimit_flushers (
    flusher TEXT NOT NULL PRIMARY KEY,
    low INTEGER NOT NULL,
    since INTEGER NOT NULL
);
