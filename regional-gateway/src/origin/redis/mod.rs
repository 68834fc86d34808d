//! The regional origin in Redis.
//!
//! Keys: `strata:{<workspace>:<namespace>:<identifier>:<duration_ms>}:<sequence>`, every part
//! percent-encoded except `[A-Za-z0-9._~-]`, so no identifier can forge a separator, a hash
//! tag brace or another tenant's key. The braces make the whole window key the Redis Cluster
//! hash tag: both cells of a window share a slot.
//!
//! A cell is a hash, the core's [`strata_core::ledger::CellLedger`] in Redis: `n` the region's
//! count, `o:<instance>` each process's cumulative own count (merged with `max`, so a replay
//! delivered twice counts once), `d:<instance>` what was passed here for it (in `n` too),
//! `i:<instance>` the last lease id it was granted, and
//! `l:<instance>` its live lease, `"<ceiling>:<id>"` (the id is the reservation deadline, made
//! strictly increasing). The leases live in the cell's hash, not beside it, so a decision
//! reads a cell and its leases with one command and writes them with one. Keys expire three
//! windows after their first write.
//! A replay batch is one script call (a bad cell fails alone); a read batch is one pipeline of
//! `HGET`s; a decision is one script per window key.
//!
//! On a Redis Cluster ([`link`]) a read batch is one `HGET` pipeline per node and a replay batch
//! one script call per node (its cells' keys undeclared but for the first, which Redis allows
//! a script flagged `allow-cross-slot-keys` for the node's own slots), sent concurrently; a
//! node that fails, or a cell whose slot moved, fails only its cells, which the next batch
//! carries again. A decision's two keys share their window's slot, and a multi-limit
//! decision's rollback goes key by key.

mod link;

use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::ConnectionLike;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use strata_core::WindowKeyRef;

use link::Link;

use super::{CellRead, CellUsed, DecideAnswer, DecideLimit, DecideOutcome, OriginError, Replayed};

/// Shared by every script: whether the lease record `v` (`"<ceiling>:<until_ms>"`, `until_ms`
/// being its id; `v` may be absent) is the lease `id`.
const LEASE_LUA: &str = r#"
local function names_lease(v, id)
  return v and string.sub(v, string.find(v, ':', 1, true) + 1) == id
end
"#;

/// The decide and the replay scripts': the cost and the lease id of a process's last counted
/// call (`'u:<instance>'` = `"<call>:<cost>:<lease id>"`) if it is call `id`, else `nil`:
/// `CellLedger::undo` takes back only that call.
const COUNTED_LUA: &str = r#"
local function counted_call(rec, id)
  if not rec or id == 0 then return nil end
  local c1 = string.find(rec, ':', 1, true)
  local c2 = string.find(rec, ':', c1 + 1, true)
  if tonumber(string.sub(rec, 1, c1 - 1)) ~= id then return nil end
  return tonumber(string.sub(rec, c1 + 1, c2 - 1)), string.sub(rec, c2 + 1)
end
"#;

/// The replay script's: drop a process's lease `id` on `cell` unless a newer grant replaced it.
const RELEASE_LUA: &str = r#"
local function release(cell, inst, id)
  if id == '0' then return end
  local f = 'l:' .. inst
  if names_lease(redis.call('HGET', cell, f), id) then
    redis.call('HDEL', cell, f)
  end
end
"#;

/// `CellLedger::make_room` over a cell's fields `t`: when `MAX_HOLDERS` processes other than
/// `except` write to it (any field of theirs: own count, decided, lease, last lease id, last
/// counted call), the `EVICT_BATCH` of them whose entries matter least (holding no lease
/// before holding one, then the smallest parts, own count and decided, then the first
/// instance ids); none below that. Both bounds are written in from the core.
const WRITERS_LUA: &str = r#"
local writer_fields = {'o:', 'd:', 'i:', 'u:', 'l:'}
local is_writer_field = {}
for _, p in ipairs(writer_fields) do is_writer_field[p] = true end
local function least_writers(t, except)
  local part, leased = {}, {}
  for f, v in pairs(t) do
    local p = string.sub(f, 1, 2)
    if is_writer_field[p] then
      local w = string.sub(f, 3)
      local add = 0
      if p == 'o:' or p == 'd:' then add = tonumber(v) or 0 end
      part[w] = (part[w] or 0) + add
      if p == 'l:' then leased[w] = 1 end
    end
  end
  local all = {}
  for w, pw in pairs(part) do
    if w ~= except then all[#all + 1] = {w = w, l = leased[w] or 0, p = pw} end
  end
  if #all < MAX_HOLDERS then return {} end
  table.sort(all, function(a, b)
    if a.l ~= b.l then return a.l < b.l end
    if a.p ~= b.p then return a.p < b.p end
    return a.w < b.w
  end)
  local victims = {}
  for j = 1, math.min(EVICT_BATCH, #all) do victims[j] = all[j].w end
  return victims
end
"#;

/// A replay batch, one script call for all its cells. KEYS: the cells. ARGV: instance, how
/// long a renewed lease is reserved (ms, on Redis's clock), then per cell its own cumulative count, the count the caller knows was acknowledged (0:
/// unknown), ttl ms, the id of a lease given back (0: none), the id of a live lease to
/// renew (0: none) and the first of its calls whose answers it lost (0: none; what the last
/// of them counted is taken back, as the decide script does). Returns per cell two values: its count after the merge (or the error text
/// of a cell that failed alone) and the renewed lease's new id (0: not renewed).
///
/// A cell costs Redis two commands when the caller's acknowledged count agrees with the own
/// count held here (the usual case, and a process's first write, acknowledged as 0): the
/// difference added to both, the check being the own count `HINCRBY` returns; three where
/// that first write makes the cell (a pass ahead on a key new to the region), and one more
/// (`HLEN`) where it is the caller's first write to a cell others made (a cell keeps at most
/// `ledger::MAX_HOLDERS` writers; past it, a full read and the deletes of the
/// `ledger::EVICT_BATCH` entries dropped).
/// Otherwise (a lost answer, lost data) it is put right with a `max`-merge, two or three
/// commands more.
/// The expiry is set once, by the write that makes the cell (the decide script sets it for
/// cells decided first), not on every replay. A renewal (once per lease lifetime of a key in
/// use, two commands: the lease read, then it and the holder's last id written) keeps the same
/// ceiling under a new id, like a grant's.
const REPLAY_LUA: &str = r#"
local inst = ARGV[1]
local f, own_lease = 'o:' .. inst, 'l:' .. inst
local clock
local function renew(cell, id)
  if id == '0' then return 0 end
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local v = redis.call('HGET', cell, own_lease)
  if not v then return 0 end
  local sep = string.find(v, ':', 1, true)
  local held = tonumber(string.sub(v, sep + 1))
  if held ~= tonumber(id) or held <= clock then return 0 end
  -- the new id only has to exceed the live lease's, the largest this holder has seen here
  -- (grants it never saw were rolled back); 'i:' keeps later grants above it
  local new = clock + tonumber(ARGV[2])
  if held >= new then new = held + 1 end
  redis.call('HSET', cell, 'i:' .. inst, string.format('%d', new),
    own_lease, string.sub(v, 1, sep) .. string.format('%d', new))
  return new
end
-- a cell keeps at most MAX_HOLDERS writers: a caller that just wrote its first count to a
-- cell others made takes the place of the entry that matters least (one command, HLEN, on a
-- cell within the bound)
local function make_room(cell)
  if redis.call('HLEN', cell) <= MAX_HOLDERS + 1 then return end
  local all = redis.call('HGETALL', cell)
  local t = {}
  for j = 1, #all, 2 do t[all[j]] = all[j + 1] end
  local victims = least_writers(t, inst)
  for _, victim in ipairs(victims) do
    for _, p in ipairs(writer_fields) do redis.call('HDEL', cell, p .. victim) end
  end
end
local function merge(cell, used, acked, ttl)
  -- nothing of its own to merge (a lease given back on a key the origin decided): the count
  if used == 0 then return tonumber(redis.call('HGET', cell, 'n') or '0') end
  if used > acked then
    -- the caller says its record here is `acked` (0: none yet): add the difference, and check
    local d = used - acked
    local v = redis.call('HINCRBY', cell, f, d)
    if v == used then
      local n = redis.call('HINCRBY', cell, 'n', d)
      if acked == 0 and n == d then
        -- the cell's first count (a pass ahead on a key new to the region): the cell was made
        redis.call('PEXPIRE', cell, ttl, 'NX')
      elseif acked == 0 then
        -- the caller's first write to a cell others made
        make_room(cell)
      end
      return n
    end
    -- it was not: put the record right (it held v - d) and merge with max
    local held = v - d
    if held == 0 then
      redis.call('PEXPIRE', cell, ttl, 'NX')
      -- no record of the caller here (its entry may have made way for another's)
      make_room(cell)
    end
    if used > held then
      redis.call('HSET', cell, f, used)
      return redis.call('HINCRBY', cell, 'n', used - held)
    end
    redis.call('HSET', cell, f, held)
    return tonumber(redis.call('HGET', cell, 'n') or '0')
  end
  local held = redis.call('HGET', cell, f)
  if used > tonumber(held or '0') then
    local n = redis.call('HINCRBY', cell, 'n', used - tonumber(held or '0'))
    redis.call('HSET', cell, f, used)
    if not held then
      redis.call('PEXPIRE', cell, ttl, 'NX')
      make_room(cell)
    end
    return n
  end
  return tonumber(redis.call('HGET', cell, 'n') or '0')
end
-- calls whose answers the caller never got: it decided those requests itself, so what the last
-- one counted here ('u:<instance>' = "<call>:<cost>:<lease id>") is taken back
local function undo(cell, from)
  if from == 0 then return end
  local undone, lease_id = counted_call(redis.call('HGET', cell, 'u:' .. inst), from)
  if not undone then return end
  if undone > 0 then
    redis.call('HINCRBY', cell, 'n', -undone)
    local d = tonumber(redis.call('HGET', cell, 'd:' .. inst) or '0')
    redis.call('HSET', cell, 'd:' .. inst, string.format('%d', math.max(d - undone, 0)))
  end
  release(cell, inst, lease_id)
  redis.call('HDEL', cell, 'u:' .. inst)
  -- the caller stays a writer of the cell, as CellLedger::undo keeps its entry
  if redis.call('HEXISTS', cell, f) == 0 and redis.call('HEXISTS', cell, 'i:' .. inst) == 0 then
    redis.call('HSET', cell, f, '0')
  end
  return tonumber(redis.call('HGET', cell, 'n') or '0')
end
local function replay(cell, used, acked, ttl, id, renewing, undo_from)
  local n = merge(cell, used, acked, ttl)
  n = undo(cell, undo_from) or n
  release(cell, inst, id)
  return n, renew(cell, renewing)
end
local out = {}
for i = 1, #keys do
  local a = 6 * i - 3 + first
  local ok, n, renewed = pcall(replay, keys[i], tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], tonumber(ARGV[a + 5]))
  if ok then
    out[2 * i - 1] = n
    out[2 * i] = renewed
  else
    if type(n) == 'table' then out[2 * i - 1] = tostring(n.err) else out[2 * i - 1] = tostring(n) end
    out[2 * i] = 0
  end
end
return out
"#;

/// Where the replay script finds its cells' keys on one Redis: `KEYS`; the per-cell values
/// start after ARGV's two.
const KEYS_DECLARED_LUA: &str = r#"
local keys, first = KEYS, 0
"#;

/// The same on a Redis Cluster node, for the cells of every slot it holds in one call: Redis
/// allows undeclared keys of the node's own slots to a script that says so (a declared key
/// must share its slot with the others, so only the first cell is declared, for routing).
/// ARGV: instance, reserve ms, the number of keys, the keys, then the per-cell values.
const KEYS_UNDECLARED_LUA: &str = r#"
local n = tonumber(ARGV[3])
local keys, first = {}, n + 1
for i = 1, n do keys[i] = ARGV[3 + i] end
"#;

/// The origin decision for one window key, atomic in Redis: merges the caller's own counts,
/// reads both cells and their live leases (dropping expired ones), applies the sliding-window
/// formula in exact integer arithmetic (doubles are exact below 2^53; the product of a count
/// and a duration is split so no intermediate exceeds that), and on a pass counts the cost
/// and records the caller's lease. KEYS: current cell, previous cell.
/// ARGV: limit, cost, duration, now, instance, used (current), used (previous), want, how
/// long a lease is reserved (ms, on Redis's clock), dry (1: never count), current global,
/// previous global, the id of the lease given back (0: none), this region's published counts
/// of the current and previous cells, undo from (0: nothing), this call's id (0: none), how
/// long a lease may be used (ms), whether the caller left the previous cell (1: its lease
/// there goes), whether the caller counts its previous share (1: it may be lent a covering
/// lease).
/// Returns {ok, current count, previous count, own count, lease, current reserved (the
/// caller's share of the previous window's weight included), the previous count as weighed
/// (its reservations in, the current cell's holders' own counts out), lease id, the caller's
/// lease record it replaced ('' if none), whether the lease covers (1)}.
///
/// Each cell is read once (`HGETALL`, its leases with it), a pass writes the current cell with
/// one `HSET` (its count, the caller's lease and lease id), and only a cell the call made gets
/// an expiry: a pass on a key seen less often than a lease lasts, the usual decision for
/// sparse keys, costs Redis 4 commands (5 on a new key), where reading and writing each field
/// by a command of its own took about 25, and the leases in hashes of their own 7 (9).
const DECIDE_LUA: &str = r#"
local function divmod(a, d)
  local q = math.floor(a / d)
  local r = a - q * d
  while r < 0 do q = q - 1; r = r + d end
  while r >= d do q = q + 1; r = r - d end
  return q, r
end
-- floor(p * l / d) for p < 2^53 and l <= d < 2^32, with every product below 2^53
local function muldiv(p, l, d)
  local q, r = divmod(p, d)
  local l1 = math.floor(l / 65536)
  local l0 = l - l1 * 65536
  local qa, ra = divmod(r * l1, d)
  local qb = divmod(ra * 65536 + r * l0, d)
  return q * l + qa * 65536 + qb
end
-- The two cells (KEYS 1..2), each read once into a table the decision reads and its writes
-- update; `size` counts each one's fields, so the script knows which cells it made (new, or
-- emptied and made again): those, and only those, get an expiry at the end.
local h, size, made = {}, {0, 0}, {false, false}
for i = 1, 2 do
  local all = redis.call('HGETALL', KEYS[i])
  local t = {}
  for j = 1, #all, 2 do t[all[j]] = all[j + 1] end
  h[i] = t
  size[i] = #all / 2
end
local function num(i, f) return tonumber(h[i][f] or '0') end
-- one HSET of `fv` (field, value, field, value, ...); the script is atomic, so a count read
-- here and set there is what HINCRBY would have made it
local inst = ARGV[5]
-- whether the caller writes to cell i already (any field of its)
local function writes(i)
  for _, p in ipairs(writer_fields) do
    if h[i][p .. inst] then return true end
  end
  return false
end
local del
-- a cell keeps at most MAX_HOLDERS writers: a caller about to write to cell i for the first
-- time takes the place of the entry that matters least (CellLedger::writer)
local function make_room(i, fv)
  if writes(i) then return end
  for j = 1, #fv, 2 do
    local f = fv[j]
    if string.sub(f, 2, 2) == ':' and string.sub(f, 3) == inst then
      local victims = least_writers(h[i], inst)
      for _, victim in ipairs(victims) do
        for _, p in ipairs(writer_fields) do del(i, p .. victim) end
      end
      return
    end
  end
end
local function set(i, fv)
  make_room(i, fv)
  local t = h[i]
  for j = 1, #fv, 2 do
    if t[fv[j]] == nil then
      if size[i] == 0 then made[i] = true end
      size[i] = size[i] + 1
    end
    t[fv[j]] = fv[j + 1]
  end
  redis.call('HSET', KEYS[i], unpack(fv))
end
del = function(i, f)
  if h[i][f] == nil then return end
  redis.call('HDEL', KEYS[i], f)
  h[i][f] = nil
  size[i] = size[i] - 1
end
-- the caller's lease field in a cell
local own_lease = 'l:' .. inst
-- merge the caller's cumulative own count ('o:'), or what it says was passed here for it
-- ('d:'), into cell i with max
local function merge_own(i, used, f)
  if used <= 0 then return end
  f = (f or 'o:') .. inst
  local held = num(i, f)
  if used > held then
    set(i, {'n', string.format('%d', num(i, 'n') + used - held), f, string.format('%d', used)})
  end
end
-- The caller's lease on cell 1 ('l:<instance>'), given back or expired, reserves nothing from
-- then on and goes at the end, unless this call grants the next one in its place: then the
-- cell's one HSET replaces it.
local drop_own = false
-- give back the caller's lease `id` on cell 1 unless a newer grant replaced it (a lease is
-- "<ceiling>:<until_ms>", and until_ms is its id)
local function release(id)
  if id ~= '0' and names_lease(h[1][own_lease], id) then drop_own = true end
end
local limit, cost, d, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local seq = math.floor(now / d)
local elapsed = now - seq * d
-- CellLedger::reserved_with: what live leases on cell i (its 'l:<holder>' fields) may still
-- admit beyond their holders' own counts, the others' and the caller's ceiling (and whether
-- it covers), and on cell 1 the others' own counts of cell 2 their covering leases cover; a
-- covering lease's record is "<ceiling>c:<until_ms>"; expired ones are dropped (clearing a
-- field while `pairs` walks the table is allowed)
local function reserved(i, now)
  local others, ceiling, holders, covered, ccov = 0, 0, 1, 0, false
  for f, v in pairs(h[i]) do
    if string.sub(f, 1, 2) == 'l:' then
      local holder, sep = string.sub(f, 3), string.find(v, ':', 1, true)
      if i == 1 and holder == inst and drop_own then
        -- given back: reserves nothing
      elseif i == 2 and holder == inst and ARGV[19] == '1' then
        -- CellLedger::retire: the caller left the previous cell, so its count there is final
        del(2, f)
      elseif tonumber(string.sub(v, sep + 1)) <= now then
        if i == 1 and holder == inst then drop_own = true else del(i, f) end
      else
        local cs = string.sub(v, 1, sep - 1)
        local cov = string.sub(cs, -1) == 'c'
        if cov then cs = string.sub(cs, 1, -2) end
        local c = tonumber(cs)
        if holder == inst then
          ceiling, ccov = c, cov
        else
          holders = holders + 1
          local own = num(i, 'o:' .. holder)
          if c > own then others = others + (c - own) end
          -- its part of cell 2: its own count and what was passed here for it
          if i == 1 and cov then covered = covered + num(2, 'o:' .. holder) + num(2, 'd:' .. holder) end
        end
      end
    end
  end
  return others, ceiling, holders, covered, ccov
end
-- Leases live on Redis's clock, one for every gateway of the region: a gateway whose clock
-- runs ahead must not see another's lease as expired while its holder still uses it.
local t = redis.call('TIME')
local clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
merge_own(1, tonumber(ARGV[6]))
merge_own(2, tonumber(ARGV[7]))
-- CellLedger::merge_decided, on the previous cell only
merge_own(2, tonumber(ARGV[21]), 'd:')
-- the lease the caller gives back: its count is merged, drop the reservation
release(ARGV[13])
-- calls whose answer the caller never got: it decided those requests itself, so what the last
-- one counted here ('u:<instance>' = "<call>:<cost>:<lease id>") is taken back
local undone, undone_lease = counted_call(h[1]['u:' .. inst], tonumber(ARGV[16]))
if undone then
  if undone > 0 then
    set(1, {'n', string.format('%d', num(1, 'n') - undone),
      'd:' .. inst, string.format('%d', math.max(num(1, 'd:' .. inst) - undone, 0))})
  end
  release(undone_lease)
  del(1, 'u:' .. inst)
  -- the caller stays a writer of the cell, as CellLedger::undo keeps its entry
  if h[1]['o:' .. inst] == nil and h[1]['i:' .. inst] == nil then set(1, {'o:' .. inst, '0'}) end
end
-- this region's published count is a floor: an origin that lost its data counts from it
for i = 1, 2 do
  local floor = tonumber(ARGV[13 + i])
  if floor > num(i, 'n') then set(i, {'n', string.format('%d', floor)}) end
end
local cur = num(1, 'n')
local prev = num(2, 'n')
-- origin_check: every live lease counts as used, the caller's too (its in-flight passes may
-- use it); a lease covers its holder's share of the previous window's weight, so the
-- previous cell weighs without the holders' own counts there, and the caller counts as a
-- holder at its ceiling or its own part now (its share rounded up), whichever is more
local others, ceiling, holders, covered, ccov = reserved(1, clock)
local po, pceiling = reserved(2, clock)
-- lease::covers: a covering lease only to a caller that counts its share, on a limit of at
-- least COVER_FACTOR costs per holder
local covers = ARGV[20] == '1' and limit >= COVER_FACTOR * math.max(cost, 1) * holders
-- the caller's own count of cell 2, as this origin holds it and, for its share, its part
-- there (that and what was passed here for it) as its call says it (a process that lost its
-- state counts from 0)
local pcount = num(2, 'o:' .. inst)
local pown = math.min(pcount, tonumber(ARGV[7])) + math.min(num(2, 'd:' .. inst), tonumber(ARGV[21]))
-- WindowDuration::previous_share: that count decayed, rounded up
local rshare = pown - muldiv(pown, elapsed, d)
local pshare = 0
if covers then pshare = rshare end
-- ledger::in_terms: the caller's live ceiling in the terms of the lease this call lends
local function in_terms(c, was)
  if c > 0 and covers and not was then return c + rshare end
  if was and not covers then return math.max(c - rshare, 0) end
  return c
end
local live = in_terms(ceiling, ccov)
local own0 = num(1, 'o:' .. inst)
local base = own0 + pshare
local hold = math.max(live, base)
local mine = hold - base
local rc = others + hold - own0
local pm = math.max(pceiling - pcount, 0)
local pw = prev + po + pm - covered
if covers then pw = pw - pown end
pw = math.max(pw, 0)
local cg, pg = tonumber(ARGV[11]), tonumber(ARGV[12])
local used = cur + rc + cg + muldiv(pw + pg, d - elapsed, d)
local ok = 0
if limit > 0 and used + cost <= limit then ok = 1 end
local lease, lease_id, before, lease_covers = 0, 0, '', 0
-- CellLedger::written_by_others on cell i: another process's own count, lease id or call
local function written_by_others(i)
  for f in pairs(h[i]) do
    local p = string.sub(f, 1, 2)
    if (p == 'o:' or p == 'd:' or p == 'i:' or p == 'u:') and string.sub(f, 3) ~= inst then return true end
  end
  return false
end
-- CellLedger::contend: a denied caller is recorded as writing to the cell (own count 0)
if ok == 0 and h[1]['o:' .. inst] == nil then set(1, {'o:' .. inst, '0'}) end
if ok == 1 and ARGV[10] ~= '1' then
  -- the cell's writes, one HSET: a pass decided here is counted in the region's count and
  -- the caller's part (no one replays it)
  local fv = {}
  local own = own0
  if cost > 0 then
    cur = cur + cost
    fv[1], fv[2] = 'n', string.format('%d', cur)
    fv[3], fv[4] = 'd:' .. inst, string.format('%d', num(1, 'd:' .. inst) + cost)
  end
  -- lease::available: the caller's live lease is raised, not added to, so what it held is
  -- available to it; a plain lease to a caller alone on the key also lends the room the
  -- previous window's decay frees before the lease ends (ARGV[18], the lease's lifetime)
  local available = limit - used - cost + mine
  local alone = cg == 0 and pg == 0 and others == 0 and po == 0 and not written_by_others(1) and not written_by_others(2)
  if alone and not covers then
    local p = pw + pg
    local later = math.min(elapsed + tonumber(ARGV[18]), d)
    available = available + muldiv(p, d - elapsed, d) - muldiv(p, d - later, d)
  end
  -- lease::grant: half of what lies above the last part of the limit, plus a small share
  -- (the divisors are the core's, written in when the script is built)
  local share = math.floor(limit / (SMALL_LEASE_DIVISOR * holders))
  local small = math.min(share, math.floor(available / 2))
  local above = math.floor(math.max(available - math.floor(limit / EXACT_ZONE_DIVISOR), 0) / 2)
  local grant = math.min(tonumber(ARGV[8]), above + small)
  -- alone, within one small share: all of it
  if alone and available <= share then grant = math.min(tonumber(ARGV[8]), available) end
  -- CellLedger::lease: a covering ceiling counts the caller's previous share beside its own
  -- count
  local raised = math.max(live, own + pshare + grant)
  if raised > own then
    lease = raised - own
    -- ids strictly increase per holder, across dropped leases too ('i:<instance>' keeps the
    -- last), so a release names exactly one grant and a holder recognises a new one
    lease_id = clock + tonumber(ARGV[9])
    local last = num(1, 'i:' .. inst)
    if last >= lease_id then lease_id = last + 1 end
    fv[#fv + 1], fv[#fv + 2] = 'i:' .. inst, string.format('%d', lease_id)
    if not drop_own then before = h[1][own_lease] or '' end
    local mark = ''
    if covers then mark = 'c' end
    fv[#fv + 1], fv[#fv + 2] = own_lease, string.format('%d%s:%d', raised, mark, lease_id)
    lease_covers = covers and 1 or 0
    drop_own = false
  end
  if ARGV[17] ~= '0' then
    fv[#fv + 1], fv[#fv + 2] = 'u:' .. inst, ARGV[17] .. ':' .. ARGV[2] .. ':' .. string.format('%d', lease_id)
  end
  if #fv > 0 then set(1, fv) end
end
if drop_own then del(1, own_lease) end
for i = 1, 2 do
  if made[i] and size[i] > 0 then redis.call('PEXPIRE', KEYS[i], d * 3) end
end
return {ok, cur, prev, num(1, 'o:' .. inst), lease, rc, pw, lease_id, before, lease_covers}
"#;

/// The decide script with the core's lease constants written in, so the port cannot drift
/// from [`strata_core::lease::grant`] by a number (a name left unreplaced is a Lua error).
fn decide_lua() -> String {
    with_ledger_bounds(format!("{LEASE_LUA}{COUNTED_LUA}{WRITERS_LUA}{DECIDE_LUA}"))
        .replace(
            "SMALL_LEASE_DIVISOR",
            &strata_core::lease::SMALL_LEASE_DIVISOR.to_string(),
        )
        .replace(
            "EXACT_ZONE_DIVISOR",
            &strata_core::lease::EXACT_ZONE_DIVISOR.to_string(),
        )
        .replace(
            "COVER_FACTOR",
            &strata_core::lease::COVER_FACTOR.to_string(),
        )
}

/// The replay script, its cells' keys found as `keys` says, with the core's bound on a
/// cell's writers written in.
fn replay_lua(keys: &str) -> String {
    with_ledger_bounds(format!(
        "{LEASE_LUA}{RELEASE_LUA}{COUNTED_LUA}{WRITERS_LUA}{keys}{REPLAY_LUA}"
    ))
}

/// A script with the core's bound on a cell's writers, and its eviction batch, written in.
fn with_ledger_bounds(lua: String) -> String {
    lua.replace("MAX_HOLDERS", &strata_core::ledger::MAX_HOLDERS.to_string())
        .replace("EVICT_BATCH", &strata_core::ledger::EVICT_BATCH.to_string())
}

/// Version prefix of every key, so a future encoding can live beside this one.
const PREFIX: &str = "strata:";

fn encode_into(out: &mut String, part: &str) {
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// The Redis key of one cell.
pub fn cell_key(key: WindowKeyRef<'_>, sequence: u64) -> String {
    let mut out = String::with_capacity(PREFIX.len() + 48 + key.identifier().len());
    out.push_str(PREFIX);
    out.push('{');
    encode_into(&mut out, key.workspace());
    out.push(':');
    encode_into(&mut out, key.namespace());
    out.push(':');
    encode_into(&mut out, key.identifier());
    let _ = write!(out, ":{}}}:{sequence}", key.duration().as_ms());
    out
}

fn backend(e: redis::RedisError) -> OriginError {
    if e.is_timeout() {
        OriginError::Timeout(Duration::ZERO)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        OriginError::Backend(format!("redis: {e}"))
    } else {
        // Redis answered: an error about the data (WRONGTYPE, a script error), not its health.
        OriginError::Rejected(format!("redis: {e}"))
    }
}

/// A Redis origin, on one node or a cluster (reconnects on its own after failures).
#[derive(Clone)]
pub struct RedisOrigin {
    link: Link,
    decide: redis::Script,
    /// The replay script's text, sent whole with each single-node batch (`EVAL`).
    replay: Arc<str>,
    /// The replay script for every cell of one cluster node (`KEYS_UNDECLARED_LUA`).
    replay_node: redis::Script,
    roll_back: redis::Script,
}

impl std::fmt::Debug for RedisOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOrigin").finish_non_exhaustive()
    }
}

/// What the decide script answered for one limit.
type ScriptReply = (u8, u64, u64, u64, u64, u64, u64, u64, String, u8);

/// Takes back one counted limit of a multi-limit request another limit denied: the cost, and
/// the lease it granted (the record it replaced comes back), unless a newer grant replaced it.
/// KEYS: the cell. ARGV: cost, instance, lease id granted (0: none), the record it
/// replaced ('' if none), the call's id (its record of what it counted goes too).
const ROLLBACK_LUA: &str = r#"
if tonumber(ARGV[1]) > 0 then
  redis.call('HINCRBY', KEYS[1], 'n', -tonumber(ARGV[1]))
  redis.call('HINCRBY', KEYS[1], 'd:' .. ARGV[2], -tonumber(ARGV[1]))
end
local rec = redis.call('HGET', KEYS[1], 'u:' .. ARGV[2])
if rec and string.sub(rec, 1, string.find(rec, ':', 1, true) - 1) == ARGV[5] then
  redis.call('HDEL', KEYS[1], 'u:' .. ARGV[2])
end
if ARGV[3] == '0' then return 0 end
local f = 'l:' .. ARGV[2]
if names_lease(redis.call('HGET', KEYS[1], f), ARGV[3]) then
  if ARGV[4] == '' then redis.call('HDEL', KEYS[1], f) else redis.call('HSET', KEYS[1], f, ARGV[4]) end
end
return 0
"#;

impl RedisOrigin {
    /// Sets up a lazily connecting client: the gateway starts (and decides locally) even if
    /// Redis is down, and connects when it comes up. `timeout` bounds every command on the
    /// connection: the longest any call may take (the caller bounds each call by its own).
    pub fn new(url: &str, timeout: Duration) -> Result<Self, OriginError> {
        let link = Link::single(url, timeout)
            .map_err(|e| OriginError::Backend(format!("invalid Redis URL: {e}")))?;
        Ok(Self::over(link))
    }

    /// The same over a Redis Cluster, from its seed nodes.
    pub fn cluster(seeds: &[String], timeout: Duration) -> Result<Self, OriginError> {
        let link = Link::cluster(seeds, timeout)
            .map_err(|e| OriginError::Backend(format!("invalid Redis Cluster seeds: {e}")))?;
        Ok(Self::over(link))
    }

    fn over(link: Link) -> Self {
        Self {
            link,
            decide: redis::Script::new(&decide_lua()),
            replay: replay_lua(KEYS_DECLARED_LUA).into(),
            replay_node: redis::Script::new(&format!(
                "#!lua flags=allow-cross-slot-keys\n{}",
                replay_lua(KEYS_UNDECLARED_LUA)
            )),
            roll_back: redis::Script::new(&format!("{LEASE_LUA}{ROLLBACK_LUA}")),
        }
    }

    /// Decides limit by limit (each window key is one script call, in its own slot); if a
    /// later limit denies, what the earlier ones counted and leased is taken back. Should
    /// taking back fail, the counts stay too high: later requests are denied early, never
    /// admitted beyond the limit.
    pub(crate) async fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        match &self.link {
            Link::Single(c) => {
                self.decide_on(&mut c.clone(), instance, limits, now_ms, lease_ms)
                    .await
            }
            Link::Cluster(c) => {
                let mut conn = c.conn().await.map_err(backend)?;
                self.decide_on(&mut conn, instance, limits, now_ms, lease_ms)
                    .await
            }
        }
    }

    async fn decide_on<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        // How long Redis reserves a lease, from its own clock.
        let reserve_ms = strata_core::lease::reserved_until(0, lease_ms);
        let mut outcomes = Vec::with_capacity(limits.len());
        let mut replaced = Vec::with_capacity(limits.len());
        let mut failed = false;
        for l in limits {
            let d = l.key.duration();
            let sequence = d.sequence(now_ms);
            let previous = sequence.saturating_sub(1);
            let reply: redis::RedisResult<ScriptReply> = self
                .decide
                .key(cell_key(l.key, sequence))
                .key(cell_key(l.key, previous))
                .arg(l.limit)
                .arg(l.cost)
                .arg(d.as_ms())
                .arg(now_ms)
                .arg(instance)
                .arg(l.used[0])
                .arg(l.used[1])
                .arg(l.want)
                .arg(reserve_ms)
                .arg(u8::from(failed))
                .arg(l.global[0])
                .arg(l.global[1])
                .arg(l.release)
                .arg(l.floor[0])
                .arg(l.floor[1])
                .arg(l.undo_from)
                .arg(l.call)
                .arg(lease_ms)
                .arg(u8::from(l.left_previous))
                .arg(u8::from(l.shares))
                .arg(l.decided[1])
                .invoke_async(conn)
                .await;
            let (ok, cur, prev, used, lease, rc, weighed, lease_id, held, covers) = match reply {
                Ok(reply) => reply,
                Err(e) => {
                    // What the earlier limits counted is taken back before the caller falls
                    // back to local memory, which counts the request itself.
                    self.roll_back(conn, instance, limits, &replaced, &mut outcomes, now_ms)
                        .await;
                    return Err(backend(e));
                }
            };
            let counted_here = ok == 1 && !failed;
            let before = if counted_here {
                cur.saturating_sub(l.cost)
            } else {
                cur
            };
            let check = strata_core::LimitCheck {
                counts: strata_core::WindowCounts {
                    current: strata_core::Counts {
                        regional: before.saturating_add(rc),
                        global: l.global[0],
                    },
                    previous: strata_core::Counts {
                        regional: weighed,
                        global: l.global[1],
                    },
                },
                duration: d,
                limit: l.limit,
                cost: l.cost,
            };
            let decision = check.decide(now_ms, 0);
            if decision.success != (ok == 1) {
                tracing::error!(
                    limit = l.limit,
                    cost = l.cost,
                    "decide script and core disagree; the script's verdict stands"
                );
            }
            let dry = failed;
            failed |= ok == 0;
            // A limit after the first denial only ran dry: like every other limit of a denied
            // request, it reports what it would have left without this request's cost.
            let decision = strata_core::Decision {
                success: ok == 1,
                ..decision
            };
            outcomes.push(DecideOutcome {
                decision: if dry {
                    decision.uncounted(l.cost)
                } else {
                    decision
                },
                sequence,
                current: cur,
                previous: prev,
                used,
                lease,
                lease_id,
                covers: covers == 1 && lease_id != 0,
            });
            replaced.push(held);
        }
        if failed {
            self.roll_back(conn, instance, limits, &replaced, &mut outcomes, now_ms)
                .await;
        }
        Ok(DecideAnswer {
            success: !failed,
            limits: outcomes,
        })
    }

    /// Takes back what the limits counted before one denied added: their cost and the
    /// leases they granted (see `ROLLBACK_LUA`).
    async fn roll_back<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        instance: &str,
        limits: &[DecideLimit<'_>],
        replaced: &[String],
        outcomes: &mut [DecideOutcome],
        now_ms: u64,
    ) {
        let mut invocations = Vec::new();
        for ((l, o), before) in limits.iter().zip(outcomes.iter_mut()).zip(replaced) {
            // Counted ones are the passes before the first denial (later ones ran dry).
            if !o.decision.success {
                break;
            }
            let sequence = l.key.duration().sequence(now_ms);
            let mut i = self.roll_back.key(cell_key(l.key, sequence));
            i.arg(l.cost)
                .arg(instance)
                .arg(o.lease_id)
                .arg(before)
                .arg(l.call);
            invocations.push(i);
            o.current = o.current.saturating_sub(l.cost);
            o.decision = o.decision.uncounted(l.cost);
            o.lease = 0;
            o.lease_id = 0;
        }
        if invocations.is_empty() {
            return;
        }
        let result = if let Link::Cluster(_) = self.link {
            // Each cell in its own slot: one call each (rare: a multi-limit request denied
            // after an earlier limit passed).
            let mut result = Ok(());
            for i in &invocations {
                if let Err(e) = i.invoke_async::<()>(conn).await {
                    result = Err(e);
                }
            }
            result
        } else {
            let mut pipe = redis::pipe();
            pipe.load_script(&self.roll_back).ignore();
            for i in &invocations {
                pipe.invoke_script(i).ignore();
            }
            pipe.query_async::<()>(conn).await
        };
        if let Err(e) = result {
            tracing::error!(error = %e, cells = invocations.len(), "multi-limit rollback failed: those cells stay over-counted until they expire");
        }
    }

    pub(crate) async fn read(&self, cells: &[CellRead<'_>]) -> Result<Vec<u64>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = cells.iter().map(|(k, s)| cell_key(*k, *s)).collect();
        let (link, conn) = match &self.link {
            Link::Single(c) => return read_counts(&mut c.clone(), &keys).await,
            Link::Cluster(c) => (c, c.conn().await.map_err(backend)?),
        };
        // One pipeline per node, all at once.
        let groups = link
            .by_node(&mut conn.clone(), &keys)
            .await
            .map_err(backend)?;
        let answers = join_all(groups.iter().map(|(slot, group)| {
            let mut conn = conn.clone();
            let mut pipe = redis::pipe();
            for &i in group {
                pipe.cmd("HGET").arg(&keys[i]).arg("n");
            }
            async move {
                let values = conn
                    .route_pipeline(pipe, 0, group.len(), on_node_of(*slot))
                    .await?;
                values
                    .into_iter()
                    .map(|v| {
                        let v = v.extract_error()?;
                        redis::from_redis_value::<Option<u64>>(v).map_err(redis::RedisError::from)
                    })
                    .collect::<redis::RedisResult<Vec<_>>>()
            }
        }))
        .await;
        let mut counts = vec![0; keys.len()];
        for ((_, group), answer) in groups.iter().zip(answers) {
            let values = answer.map_err(|e| {
                link.forget_slots();
                backend(e)
            })?;
            for (&i, n) in group.iter().zip(values) {
                counts[i] = n.unwrap_or(0);
            }
        }
        Ok(counts)
    }

    pub(crate) async fn replay(
        &self,
        instance: &str,
        cells: &[CellUsed<'_>],
        lease_ms: u64,
    ) -> Result<Vec<Option<Replayed>>, OriginError> {
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let (link, conn) = match &self.link {
            Link::Single(c) => {
                // One command for the batch, the script sent whole (`EVAL`, which Redis
                // caches compiled by its hash): a restarted Redis never answers NOSCRIPT,
                // and a batch whose answer timed out is still applied once Redis reads it.
                // (`SCRIPT LOAD` then `EVALSHA` in one round trip sent the same bytes as two
                // commands.)
                let counts: Vec<redis::Value> = self
                    .replay_eval(instance, cells, lease_ms)
                    .query_async(&mut c.clone())
                    .await
                    .map_err(backend)?;
                return replayed(counts, cells);
            }
            Link::Cluster(c) => (c, c.conn().await.map_err(backend)?),
        };
        // One script call per node, all at once, for the cells of every slot it holds
        // (`KEYS_UNDECLARED_LUA`). A node whose call fails fails only its cells: the next batch
        // carries them again, after reading the slot map afresh, and the others are not sent
        // twice; a call repeated (the client follows a redirect by sending it again) counts
        // nothing twice, since replays merge with max. A cell the node did not hold (the map
        // was stale) fails alone, the same way.
        let keys: Vec<String> = cells.iter().map(|c| cell_key(c.key, c.sequence)).collect();
        let groups = link
            .by_node(&mut conn.clone(), &keys)
            .await
            .map_err(backend)?;
        let answers = join_all(groups.iter().map(|(_, group)| {
            let mut conn = conn.clone();
            let node_cells: Vec<CellUsed<'_>> = group.iter().map(|&i| cells[i]).collect();
            let mut invocation = self.replay_node.prepare_invoke();
            invocation
                .key(&keys[group[0]])
                .arg(instance)
                .arg(strata_core::lease::reserved_until(0, lease_ms))
                .arg(group.len());
            for &i in group {
                invocation.arg(&keys[i]);
            }
            for c in &node_cells {
                for v in replay_values(c) {
                    invocation.arg(v);
                }
            }
            async move {
                let counts = invocation
                    .invoke_async::<Vec<redis::Value>>(&mut conn)
                    .await
                    .map_err(backend)?;
                let results = replayed(counts, &node_cells)?;
                Ok::<_, OriginError>(group.iter().copied().zip(results).collect::<Vec<_>>())
            }
        }))
        .await;
        let mut out = vec![None; cells.len()];
        let mut failure = None;
        let mut delivered = false;
        for ((_, group), answer) in groups.iter().zip(answers) {
            match answer {
                Ok(results) => {
                    delivered = true;
                    if results.iter().any(|(_, r)| r.is_none()) {
                        // A cell failed alone: maybe its slot moved.
                        link.forget_slots();
                    }
                    for (i, r) in results {
                        out[i] = r;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, cells = group.len(), "replay to one Redis Cluster node failed");
                    link.forget_slots();
                    failure = Some(e);
                }
            }
        }
        match failure {
            // Nothing went through: the origin is down, as far as this batch can tell.
            Some(e) if !delivered => Err(e),
            _ => Ok(out),
        }
    }

    /// The single-node replay of `cells`: `EVAL` of the replay script, the cells' keys, then
    /// the instance, the renewal's reservation, and per cell its values.
    fn replay_eval(&self, instance: &str, cells: &[CellUsed<'_>], lease_ms: u64) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(&*self.replay).arg(cells.len());
        for c in cells {
            cmd.arg(cell_key(c.key, c.sequence));
        }
        cmd.arg(instance)
            .arg(strata_core::lease::reserved_until(0, lease_ms));
        for c in cells {
            cmd.arg(&replay_values(c)[..]);
        }
        cmd
    }

    pub(crate) async fn ping(&self) -> Result<(), OriginError> {
        match &self.link {
            Link::Single(c) => {
                let _: String = redis::cmd("PING")
                    .query_async(&mut c.clone())
                    .await
                    .map_err(backend)?;
            }
            Link::Cluster(c) => {
                // Ready when every primary answers: a down node's slots would fail.
                let mut conn = c.conn().await.map_err(backend)?;
                conn.route_command(
                    redis::cmd("PING"),
                    RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::AllSucceeded),
                    )),
                )
                .await
                .and_then(|v| v.extract_error())
                .map_err(backend)?;
            }
        }
        Ok(())
    }
}

/// `HGET <key> n` for every key, in one pipeline, on one Redis.
async fn read_counts(
    conn: &mut redis::aio::ConnectionManager,
    keys: &[String],
) -> Result<Vec<u64>, OriginError> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd("HGET").arg(key).arg("n");
    }
    let values: Vec<Option<u64>> = pipe.query_async(conn).await.map_err(backend)?;
    Ok(values.into_iter().map(|v| v.unwrap_or(0)).collect())
}

/// One cell's values in a replay script call (`REPLAY_LUA`'s ARGV, per cell): its own
/// cumulative count, the acknowledged count, the expiry (ms), the lease given back and the
/// lease to renew, and the first call to undo.
fn replay_values(c: &CellUsed<'_>) -> [u64; 6] {
    [
        c.used,
        c.acked,
        c.key.duration().as_ms().saturating_mul(3),
        c.release,
        c.renew,
        c.undo_from,
    ]
}

/// Routes a pipeline to the primary that holds `slot`.
fn on_node_of(slot: u16) -> SingleNodeRoutingInfo {
    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master))
}

/// The replay script's answer for `cells`: per cell its count after the merge and the renewed
/// lease, or `None` for a cell that failed alone.
fn replayed(
    counts: Vec<redis::Value>,
    cells: &[CellUsed<'_>],
) -> Result<Vec<Option<Replayed>>, OriginError> {
    if counts.len() != 2 * cells.len() {
        return Err(OriginError::Rejected(format!(
            "redis: the replay script answered {} values for {} cells",
            counts.len(),
            cells.len()
        )));
    }
    Ok(counts
        .chunks_exact(2)
        .zip(cells)
        .map(|(pair, c)| match pair {
            [redis::Value::Int(n), redis::Value::Int(renewed)] => Some(Replayed {
                count: u64::try_from(*n).ok()?,
                renewed: u64::try_from(*renewed).unwrap_or(0),
            }),
            other => {
                tracing::warn!(error = ?other.first(), cell = %cell_key(c.key, c.sequence), "replay of one cell failed");
                None
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_core::WindowDuration;

    fn key<'a>(ws: &'a str, ns: &'a str, id: &'a str) -> WindowKeyRef<'a> {
        WindowKeyRef::new(ws, ns, id, WindowDuration::from_ms(60_000).unwrap()).unwrap()
    }

    #[test]
    fn keys_put_the_window_key_in_one_hash_tag() {
        assert_eq!(
            cell_key(key("acme", "api", "user-1"), 7),
            "strata:{acme:api:user-1:60000}:7"
        );
    }

    #[test]
    fn separators_braces_and_bytes_are_encoded() {
        let k = cell_key(key("a:b", "{x}", "ü %"), 1);
        assert_eq!(k, "strata:{a%3Ab:%7Bx%7D:%C3%BC%20%25:60000}:1");
        // Exactly one brace pair: the hash tag is the whole window key.
        assert_eq!(k.matches('{').count(), 1);
        assert_eq!(k.matches('}').count(), 1);
    }

    #[test]
    fn parts_cannot_trade_characters() {
        assert_ne!(
            cell_key(key("ws", "a:b", "c"), 1),
            cell_key(key("ws", "a", "b:c"), 1)
        );
        assert_ne!(
            cell_key(key("ws", "a%3Ab", "c"), 1),
            cell_key(key("ws", "a:b", "c"), 1)
        );
    }
}
