-- A sync reads only the cells with a row written since its last read (`updated_at`, stamped
-- with the database's clock by every flush), then every row of those cells: this index finds
-- them without reading the table.
CREATE INDEX ratelimit_window_counts_updated_idx ON ratelimit_window_counts (updated_at);
