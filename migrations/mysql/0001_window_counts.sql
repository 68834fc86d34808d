-- Global counters: one row per region and window cell (a G-Counter component).
-- Binary collation: identifiers are compared byte-wise, so `Key` and `key` are two rows (the
-- default utf8mb4 collation is case-insensitive and would merge them into one).
-- The unique index spans 4 x (191 + 255 + 255 + 48) + 16 = 3,012 bytes, under InnoDB's 3,072.
CREATE TABLE IF NOT EXISTS ratelimit_window_counts (
    pk BIGINT UNSIGNED AUTO_INCREMENT NOT NULL,
    workspace_id VARCHAR(191) NOT NULL,
    namespace VARCHAR(255) NOT NULL,
    identifier VARCHAR(255) NOT NULL,
    duration_ms BIGINT UNSIGNED NOT NULL,
    sequence BIGINT NOT NULL,
    region VARCHAR(48) NOT NULL,
    count BIGINT UNSIGNED NOT NULL,
    expires_at BIGINT UNSIGNED NOT NULL,
    updated_at BIGINT UNSIGNED NOT NULL,
    CONSTRAINT ratelimit_window_counts_pk PRIMARY KEY (pk),
    CONSTRAINT unique_window_region UNIQUE (workspace_id, namespace, identifier, duration_ms, sequence, region),
    INDEX expires_at_idx (expires_at),
    INDEX lookup_idx (workspace_id, namespace, identifier, duration_ms, sequence)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
