-- Nothing to change: SQLite compares TEXT with its BINARY collation (memcmp, no padding), so
-- keys differing by a trailing space were always distinct rows. Kept so both dialects share
-- one schema version.
SELECT 1;
