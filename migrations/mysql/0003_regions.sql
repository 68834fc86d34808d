-- The regions publishing to the global table, each with the last time one of its gateways said
-- so (Unix ms). Gateways divide the publish floor among the regions seen lately, so traffic
-- spread evenly over every region is published before the regions together hold more than the
-- floor unseen.
CREATE TABLE ratelimit_regions (
    region VARBINARY(48) NOT NULL PRIMARY KEY,
    seen_at BIGINT UNSIGNED NOT NULL
);
