-- Global counters: one row per region and window cell (a G-Counter component).
-- SQLite compares TEXT byte-wise (BINARY collation) by default, like the MySQL table's utf8mb4_bin.
CREATE TABLE IF NOT EXISTS ratelimit_window_counts (
    pk INTEGER PRIMARY KEY AUTOINCREMENT,
    workspace_id TEXT NOT NULL,
    namespace TEXT NOT NULL,
    identifier TEXT NOT NULL,
    duration_ms INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    region TEXT NOT NULL,
    count INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    CONSTRAINT unique_window_region UNIQUE (workspace_id, namespace, identifier, duration_ms, sequence, region)
);
CREATE INDEX IF NOT EXISTS expires_at_idx ON ratelimit_window_counts (expires_at);
CREATE INDEX IF NOT EXISTS lookup_idx ON ratelimit_window_counts (workspace_id, namespace, identifier, duration_ms, sequence);
