-- Identity columns become byte strings. utf8mb4_bin is a PAD SPACE collation: "victim" and
-- "victim " compared equal and shared one row, so one client's count hid behind another's.
-- VARBINARY compares bytes with no padding, on MySQL and MariaDB alike; the lengths are the
-- identity bounds in bytes, so the unique index shrinks to 191 + 255 + 255 + 48 + 16 bytes.
-- Rows already merged by the old collation stay merged; new ones are distinct.
ALTER TABLE ratelimit_window_counts
    MODIFY workspace_id VARBINARY(191) NOT NULL,
    MODIFY namespace VARBINARY(255) NOT NULL,
    MODIFY identifier VARBINARY(255) NOT NULL,
    MODIFY region VARBINARY(48) NOT NULL;
