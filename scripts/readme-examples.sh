#!/usr/bin/env bash
# Runs every example of README.md's "Run" section (and its subsections) the way a reader would,
# and checks what the README says they print. The examples are parsed from README.md at run time
# (indented 4-space code blocks and fenced blocks), so this test follows the README as it changes.
#
# How a block is read:
#   - a command is a line (plus continuation lines until `bash -n` accepts it); with `$ ` prompts
#     in a block, only prompted lines are commands;
#   - a line starting with `{"` or `[` after a command is that command's expected output;
#   - a comment line holding a JSON fragment (`# {"success":true,...}: prose`) is an expectation
#     on the previous command; `...` means "more fields"; a clause "next N requests: X left, then
#     denied" in the prose reruns the command N times and checks each answer;
#   - fields are compared as the README shows them, except `reset` (a timestamp: only checked to
#     be an integer); without `...` the answer must have exactly the fields shown.
# How it is run:
#   - each block runs as one bash script (one shell, as a reader pasting it), in its own process
#     group, with the working directory a scratch directory: `./strata-data` starts clean, and
#     `target/release` there is a symlink to "$CARGO_TARGET_DIR/<profile>" (the repository's
#     own `target/` is never touched); `cargo` is a shell function adding `--manifest-path` of
#     this checkout, as if the reader stood in its root;
#   - the profile is the debug build by default, which the test command's `cargo test` has
#     already made: the shell function drops `--release` from the README's cargo commands, and
#     `target/release` points at the debug binaries (README_EXAMPLES_PROFILE=release runs the
#     release build the README names, building it first);
#   - a gateway the README starts (`cargo run ...`, `... strata-gateway ... &`) runs in the
#     background until the next block that starts one (or the end), and is polled with a deadline
#     until /readyz answers 200; it is stopped with SIGTERM and must exit within 15 s;
#   - a block that only starts a gateway and has no requests of its own (the Redis variant) is
#     exercised with the latest earlier block that sent requests to the same port, comparing
#     `remaining` as an upper bound (the shared Redis keeps counts across runs);
#   - a `--redis-url` must answer PING before the gateway starts (fail, never skip); an absolute
#     `--data-dir` (the README's /tmp/strata) must not exist beforehand and is removed at exit;
#     ports the README uses must be free.
# Prints `ok   <name>` / `FAIL <name>: why` per example and `N passed, N failed`; exits 1 if any
# failed. Not run here: the README's Test command (it calls this script).
#
# Settings: README_EXAMPLES_PROFILE (debug or release, default debug: see above),
# README_EXAMPLES_BUILD_TIMEOUT (s, default 1800) bounds cargo (build and lock waits),
# README_EXAMPLES_READY_TIMEOUT (s, default 30) bounds a started gateway reaching /readyz 200,
# README_EXAMPLES_KEEP=1 keeps the scratch directory (kept anyway when an example fails);
# README_EXAMPLES_README=<file> reads another copy of the README (for testing this script).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
README=$(realpath -- "${README_EXAMPLES_README:-$REPO/README.md}")
cd "$REPO"
# Where cargo builds for this checkout (its own `target/` unless told otherwise).
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
# cargo resolves a relative CARGO_TARGET_DIR against its working directory; the examples run
# elsewhere, so pin it to what it means from the repository root.
CARGO_TARGET_DIR=$(realpath -m -- "$CARGO_TARGET_DIR")
export CARGO_TARGET_DIR

PROFILE=${README_EXAMPLES_PROFILE:-debug}
case $PROFILE in
  debug | release) ;;
  *)
    echo "README_EXAMPLES_PROFILE must be debug or release, not '$PROFILE'" >&2
    exit 2
    ;;
esac
export README_EXAMPLES_PROFILE=$PROFILE
BUILD_TIMEOUT=${README_EXAMPLES_BUILD_TIMEOUT:-1800}
READY_TIMEOUT=${README_EXAMPLES_READY_TIMEOUT:-30}
STOP_TIMEOUT=15
DATA_TIMEOUT=10
STEP_SLACK=120
LOCK=/tmp/strata-readme-examples.lock # ports 8080-8082 and /tmp/strata are machine-wide

# ---------------------------------------------------------------------------------------------
# Results: one line per example, printed in README order as soon as it is final (an example that
# started a gateway is final once that gateway has stopped).
names=()
results=()
final=()
printed=0
passed=0
failed=0

flush_results() {
  while [ "$printed" -lt "${#names[@]}" ] && [ "${final[$printed]}" = 1 ]; do
    if [ "${results[$printed]}" = ok ]; then
      printf 'ok   %s\n' "${names[$printed]}"
      passed=$((passed + 1))
    else
      printf 'FAIL %s: %s\n' "${names[$printed]}" "${results[$printed]}"
      failed=$((failed + 1))
    fi
    printed=$((printed + 1))
  done
}

add_result() { # name result final
  names+=("$1")
  results+=("$2")
  final+=("$3")
  flush_results
}

fail_result() { # index reason: keeps the first failure of an example
  if [ "${results[$1]}" = ok ]; then results[$1]=$2; fi
}

finish() { # prints the summary (the last line) and exits
  for i in "${!final[@]}"; do final[$i]=1; done
  flush_results
  if [ -n "$WORK" ] && { [ "$keep_work" = 1 ] || [ "$failed" -gt 0 ]; }; then
    echo "(scratch directory kept: $WORK)" >&2
  fi
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ] && exit 0
  exit 1
}

# ---------------------------------------------------------------------------------------------
# Process groups: each block runs in its own session (setsid); gateways stay in it.
sessions=() # "pgid:example-index" of groups whose gateways are still running
runner_pgid=""

group_alive() { # pgid: is any live (non-zombie) process left in the process group?
  local want=$1 p stat
  local -a f
  for p in /proc/[0-9]*; do
    read -r stat 2>/dev/null <"$p/stat" || continue
    read -r -a f <<<"${stat##*) }" # state ppid pgrp ...
    if [ "${f[2]:-}" = "$want" ] && [ "${f[0]:-}" != Z ] && [ "${f[0]:-}" != X ]; then return 0; fi
  done
  return 1
}

stop_group() { # pgid -> 0 if it exited within STOP_TIMEOUT of SIGTERM, 1 if it had to be killed
  local pgid=$1 end
  group_alive "$pgid" || return 0
  kill -TERM -- "-$pgid" 2>/dev/null || true
  end=$((SECONDS + STOP_TIMEOUT))
  while group_alive "$pgid"; do
    if [ "$SECONDS" -ge "$end" ]; then
      kill -KILL -- "-$pgid" 2>/dev/null || true
      end=$((SECONDS + 5))
      while group_alive "$pgid" && [ "$SECONDS" -lt "$end" ]; do sleep 0.1; done
      return 1
    fi
    sleep 0.1
  done
  return 0
}

stop_sessions() { # stop every running gateway group; a gateway that ignores SIGTERM fails its example
  local s
  for s in "${sessions[@]}"; do
    if ! stop_group "${s%%:*}"; then
      fail_result "${s##*:}" "a gateway did not exit within ${STOP_TIMEOUT}s of SIGTERM (README: \"SIGTERM or Ctrl-C stops accepting, finishes in-flight requests\"); killed"
    fi
    final[${s##*:}]=1
  done
  sessions=()
  flush_results
}

created_dirs=()
WORK=""
keep_work=${README_EXAMPLES_KEEP:-0}
RUN_WHY=""

cleanup() {
  local rc=$? d
  trap - EXIT INT TERM
  [ -n "$runner_pgid" ] && { stop_group "$runner_pgid" || true; }
  local s
  for s in "${sessions[@]}"; do stop_group "${s%%:*}" || true; done
  for d in "${created_dirs[@]}"; do
    case $d in /?*) rm -rf -- "$d" ;; esac
  done
  if [ -n "$WORK" ] && [ -d "$WORK" ]; then
    if [ "$keep_work" != 1 ] && [ "$failed" -eq 0 ] && [ "$rc" -eq 0 ]; then rm -rf -- "$WORK"; fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# Helpers that run inside each block's runner script (serialised there with declare -f). They use
# __EX (the example's directory) and the __*_TIMEOUT values written into the runner.

__fail() { # records why the example failed (plus any background command that died) and exits
  local msg=$* b cur
  cur=$(cat "$__EX/step" 2>/dev/null)
  for b in "${__BG[@]}"; do
    [ "${b%%:*}" = "$cur" ] && continue
    __alive "${b##*:}" || msg+="; meanwhile the background $(__what "${b%%:*}") had exited: $(__tail "${b%%:*}")"
  done
  printf '%s\n' "$msg" | tr '\n' ' ' >"$__EX/fail"
  exit 1
}

__step() { printf '%s\n' "$1" >"$__EX/step"; }

__what() { # id -> "`first line of the command`"
  local l
  l=$(head -n1 "$__EX/${1%%.r*}.cmd" 2>/dev/null)
  printf '`%.70s%s`' "$l" "$([ "${#l}" -le 70 ] || echo ...)"
}

__tail() { # id -> the telling line of the step's stderr (else stdout)
  local f l e=$'\e'
  for f in "$__EX/$1.err" "$__EX/$1.out"; do
    [ -s "$f" ] || continue
    l=$(sed "s/$e\\[[0-9;]*m//g" "$f" | grep -m1 -E '^(error|fatal|strata-gateway:)' || true)
    [ -n "$l" ] || l=$(sed "s/$e\\[[0-9;]*m//g" "$f" | grep -v '^[[:space:]]*$' | tail -n1)
    if [ -n "$l" ]; then
      printf '%.240s' "$l"
      return
    fi
  done
  printf 'no output'
}

__check_rc() { # id rc
  local hint=""
  [ "$2" = 0 ] && return 0
  case $2 in 7) hint=" (curl: could not connect)" ;; 28) hint=" (curl: timed out)" ;; esac
  __fail "$(__what "$1") exited with status $2$hint: $(__tail "$1")"
}

__alive() { # pid: running and not a zombie
  local s
  kill -0 "$1" 2>/dev/null || return 1
  read -r s 2>/dev/null <"/proc/$1/stat" || return 1
  s=${s##*) }
  case ${s%% *} in Z | X) return 1 ;; esac
  return 0
}

__json_fields() { # stdin: a stream of JSON values -> "idx<TAB>key<TAB>raw value" per top-level
  # field of each object ("idx<TAB><TAB>raw" for other values), then "N<TAB>count"; status 1 if
  # the text is not a stream of JSON objects/arrays. Whitespace outside strings is dropped.
  awk 'BEGIN { RS = "\001" } { t = t $0 "\n" }
  END {
    n = length(t); d = 0; q = 0; e = 0; idx = 0; tok = ""; key = ""; obj = 0; bad = 0
    for (i = 1; i <= n; i++) {
      c = substr(t, i, 1)
      if (q) { tok = tok c; if (e) e = 0; else if (c == "\\") e = 1; else if (c == "\"") q = 0; continue }
      if (c == " " || c == "\t" || c == "\n" || c == "\r") continue
      if (d == 0) {
        if (c == "{") { idx++; d = 1; obj = 1; tok = ""; key = ""; continue }
        if (c == "[") { idx++; d = 1; obj = 0; tok = "["; continue }
        bad = 1; break
      }
      if (c == "\"") { q = 1; tok = tok c; continue }
      if (c == "{" || c == "[") { d++; tok = tok c; continue }
      if (c == "}" || c == "]") {
        d--
        if (d == 0) {
          if (obj) { if (key != "") print idx "\t" key "\t" tok; else if (tok != "") bad = 1 }
          else print idx "\t\t" tok c
          tok = ""; key = ""; continue
        }
        tok = tok c; continue
      }
      if (d == 1 && obj && c == ":") {
        if (tok !~ /^".*"$/) { bad = 1; break }
        key = substr(tok, 2, length(tok) - 2); tok = ""; continue
      }
      if (d == 1 && obj && c == ",") {
        if (key == "") { bad = 1; break }
        print idx "\t" key "\t" tok; key = ""; tok = ""; continue
      }
      tok = tok c
    }
    if (d != 0 || q) bad = 1
    if (bad) exit 1
    print "N\t" idx
  }'
}

__short() { local s; s=$(printf '%s' "$1" | tr -d '\n'); printf '%.200s' "${s:-<nothing>}"; }

__compare() { # actual mode(exact|relaxed) expected... -> reason on stdout and status 1 if different
  local actual=$1 mode=$2
  shift 2
  local -A A=() AK=()
  local fields i key val na=0 j=0 e ell e2 a k keys_e
  fields=$(printf '%s' "$actual" | __json_fields) || {
    echo "answer is not JSON: $(__short "$actual")"
    return 1
  }
  while IFS=$'\t' read -r i key val; do
    if [ "$i" = N ]; then na=$key; continue; fi
    A["$i|$key"]=$val
    AK[$i]="${AK[$i]-} $key"
  done <<<"$fields"
  if [ "$na" -ne "$#" ]; then
    echo "expected $# JSON answer(s) as the README shows, got $na: $(__short "$actual")"
    return 1
  fi
  for e in "$@"; do
    j=$((j + 1))
    ell=0
    case $e in *...*) ell=1 ;; esac
    e2=${e//,.../}
    e2=${e2//...,/}
    e2=${e2//.../}
    fields=$(printf '%s' "$e2" | __json_fields) || {
      echo "cannot read the README's expected output: $e"
      return 1
    }
    keys_e=""
    while IFS=$'\t' read -r i key val; do
      [ "$i" = N ] && continue
      keys_e="$keys_e $key"
      if [ -z "${A["$j|$key"]+x}" ]; then
        echo "answer has no \"$key\" (README: $e): $(__short "$actual")"
        return 1
      fi
      a=${A["$j|$key"]}
      case $key in
        reset)
          [[ $a =~ ^[0-9]+$ ]] || {
            echo "\"reset\" is $a, not a Unix time in ms: $(__short "$actual")"
            return 1
          }
          ;;
        *)
          if [ "$mode" = relaxed ] && [ "$key" = remaining ] && [[ $val =~ ^[0-9]+$ ]]; then
            [[ $a =~ ^[0-9]+$ ]] && [ "$a" -le "$val" ] || {
              echo "expected \"remaining\" at most $val, got $a: $(__short "$actual")"
              return 1
            }
          elif [ "$a" != "$val" ]; then
            echo "expected \"$key\":$val (README: $e), got \"$key\":$a in $(__short "$actual")"
            return 1
          fi
          ;;
      esac
    done <<<"$fields"
    if [ "$ell" = 0 ]; then
      k=$(tr ' ' '\n' <<<"${AK[$j]-}" | sort | tr '\n' ' ')
      keys_e=$(tr ' ' '\n' <<<"$keys_e" | sort | tr '\n' ' ')
      if [ "$k" != "$keys_e" ]; then
        echo "answer has fields [${k# }], the README shows [${keys_e# }]: $(__short "$actual")"
        return 1
      fi
    fi
  done
  return 0
}

__expect() { # id label mode expected...
  local id=$1 label=$2 mode=$3 msg
  shift 3
  msg=$(__compare "$(cat "$__EX/$id.out")" "$mode" "$@") || __fail "$(__what "$id")$label: $msg"
}

__no_errors() { # id: output that is JSON must not hold an error answer
  local out fields
  out=$(cat "$__EX/$1.out")
  case $out in "{"* | "[{"*) ;; *) return 0 ;; esac
  fields=$(printf '%s' "$out" | __json_fields) || return 0
  if grep -q $'^[0-9]*\terror\t' <<<"$fields"; then
    __fail "$(__what "$1") answered an error: $(__short "$out")"
  fi
}

__ready() { # id host port pid mode(build|run) data-dir: poll until /readyz answers 200
  local id=$1 host=$2 port=$3 pid=$4 mode=$5 data=$6 end code
  if [ "$mode" = build ]; then # cargo: building (or waiting for the build lock) first
    end=$((SECONDS + __BUILD_TIMEOUT))
    until grep -q 'Running' "$__EX/$id.err" 2>/dev/null; do
      __alive "$pid" || __fail "$(__what "$id") exited before the gateway ran: $(__tail "$id")"
      [ "$SECONDS" -lt "$end" ] || __fail "$(__what "$id"): cargo did not finish within ${__BUILD_TIMEOUT}s: $(__tail "$id")"
      sleep 0.2
    done
  fi
  end=$((SECONDS + __READY_TIMEOUT))
  while :; do
    __alive "$pid" || __fail "$(__what "$id") exited before /readyz answered 200: $(__tail "$id")"
    code=$(curl -s -o "$__EX/$id.readyz" -w '%{http_code}' --max-time 2 "http://$host:$port/readyz") || code=000
    [ "$code" = 200 ] && break
    [ "$SECONDS" -lt "$end" ] ||
      __fail "$(__what "$id"): /readyz on $host:$port answered $code, not 200, for ${__READY_TIMEOUT}s: $(__short "$(cat "$__EX/$id.readyz" 2>/dev/null)")"
    sleep 0.2
  done
  [ -n "$data" ] || return 0
  end=$((SECONDS + __DATA_TIMEOUT))
  until [ -n "$(find "$data" -maxdepth 1 -type f 2>/dev/null | head -n1)" ]; do
    [ "$SECONDS" -lt "$end" ] || __fail "$(__what "$id"): no global-table file under its data dir $data within ${__DATA_TIMEOUT}s of /readyz 200"
    sleep 0.2
  done
}

RUNNER_HELPERS=(__fail __step __what __tail __check_rc __alive __json_fields __short __compare
  __expect __no_errors __ready)

# ---------------------------------------------------------------------------------------------
# Reading the README.

extract_blocks() { # README dir -> dir/NNN.txt, NNN.head (nearest heading), NNN.lang
  awk -v dir="$2" '
    function close_block() { if (blk) { close(out); blk = 0 } pend = 0 }
    function open_block(kind,   f) {
      nb++; out = sprintf("%s/%03d.txt", dir, nb)
      f = sprintf("%s/%03d.head", dir, nb); print head > f; close(f)
      f = sprintf("%s/%03d.lang", dir, nb); print kind > f; close(f)
      printf "" > out; blk = 1
    }
    BEGIN { insec = 0; infence = 0; blk = 0; prevblank = 1; seen = 0 }
    {
      line = $0; sub(/\r$/, "", line)
      if (infence) {
        if (line ~ /^ ? ? ?(```|~~~)[`~]*[ \t]*$/ && index(line, fence) > 0) { infence = 0; close_block(); prevblank = 0; next }
        if (blk) print line > out
        next
      }
      if (line ~ /^ ? ? ?(```|~~~)/) {
        close_block()
        fence = (index(line, "```") > 0) ? "```" : "~~~"
        lang = line; sub(/^ *[`~]+[ \t]*/, "", lang); sub(/[ \t].*$/, "", lang)
        infence = 1
        if (insec) open_block("fenced:" lang)
        next
      }
      if (line ~ /^#+[ \t]/) {
        close_block()
        lvl = 0; while (substr(line, lvl + 1, 1) == "#") lvl++
        title = line; sub(/^#+[ \t]+/, "", title); sub(/[ \t]+#*[ \t]*$/, "", title)
        if (lvl <= 2) { insec = (lvl == 2 && title == "Run"); if (insec) seen = 1 }
        if (insec) head = title
        prevblank = 1; next
      }
      if (insec && line ~ /^(    |\t)/ && (blk || prevblank)) {
        if (!blk) open_block("indented")
        for (k = 0; k < pend; k++) print "" > out
        pend = 0
        sub(/^(    |\t)/, "", line); print line > out
        prevblank = 0; next
      }
      if (line ~ /^[ \t]*$/) { if (blk) pend++; prevblank = 1; next }
      close_block(); prevblank = 0
    }
    END { close_block(); if (!seen) exit 3 }
  ' "$1"
}

table_default() { # flag -> the first `value` in the default column of the README's settings table
  awk -F'|' -v flag="\`$1\`" '
    { c = $2; gsub(/^[ \t]+|[ \t]+$/, "", c) }
    c == flag || index(c, flag ",") == 1 {
      v = $4; if (match(v, /`[^`]*`/)) { print substr(v, RSTART + 1, RLENGTH - 2); exit }
    }' "$README" | head -n1
}

trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; s=${s%"${s##*[![:space:]]}"}; printf '%s' "$s"; }

word_number() {
  case $1 in
    one) echo 1 ;; two) echo 2 ;; three) echo 3 ;; four) echo 4 ;; five) echo 5 ;;
    six) echo 6 ;; seven) echo 7 ;; eight) echo 8 ;; nine) echo 9 ;; ten) echo 10 ;;
    *) [[ $1 =~ ^[0-9]+$ ]] && echo "$1" ;;
  esac
}

split_fragment() { # "{...}: prose" -> sets FRAG (the leading JSON-ish fragment) and PROSE
  local s=$1 i c d=0 q=0 esc=0
  FRAG=""
  PROSE=""
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    if [ "$q" = 1 ]; then
      if [ "$esc" = 1 ]; then esc=0; elif [ "$c" = '\' ]; then esc=1; elif [ "$c" = '"' ]; then q=0; fi
      continue
    fi
    case $c in
      '"') q=1 ;;
      '{' | '[') d=$((d + 1)) ;;
      '}' | ']')
        d=$((d - 1))
        if [ "$d" = 0 ]; then
          FRAG=${s:0:i+1}
          PROSE=$(trim "${s:i+1}")
          PROSE=$(trim "${PROSE#:}")
          return 0
        fi
        ;;
    esac
  done
  return 1
}

prose_reruns() { # prose -> expected fragments (one a line) for "next N requests: ..." clauses
  local clause n o count
  local -a clauses outcomes
  IFS=';' read -r -a clauses <<<"$1"
  for clause in "${clauses[@]}"; do
    clause=$(trim "$clause")
    [[ $clause =~ next[[:space:]]+([A-Za-z0-9]+)[[:space:]]+requests?:[[:space:]]*(.*)$ ]] || continue
    n=$(word_number "${BASH_REMATCH[1]}")
    IFS=',' read -r -a outcomes <<<"${BASH_REMATCH[2]}"
    [ -n "$n" ] || return 1
    count=0
    for o in "${outcomes[@]}"; do
      o=$(trim "$o")
      o=${o#then }
      o=${o#and }
      o=$(trim "${o%.}")
      count=$((count + 1))
      if [[ $o =~ ^([0-9]+)\ left$ ]]; then
        printf '{"success":true,"remaining":%s,...}\n' "${BASH_REMATCH[1]}"
      elif [[ $o =~ ^(denied|rejected|refused)$ ]]; then
        printf '{"success":false,...}\n'
      elif [[ $o =~ ^(passes|passed|pass|allowed|admitted)$ ]]; then
        printf '{"success":true,...}\n'
      else
        return 1
      fi
    done
    [ "$count" = "$n" ] || return 1
  done
  return 0
}

is_output_line() { # a line that is expected output rather than a command (JSON)
  local re='^[[:space:]]*(\{["}]|\[[]["{0-9tfn-])'
  [[ $1 =~ $re ]]
}

arg_value() { # command-text flag -> the flag's value (`--flag v` or `--flag=v`), else nothing
  local re="(^|[[:space:]])$2(=|[[:space:]]+)([^[:space:]\\\\]+)"
  [[ $1 =~ $re ]] && printf '%s' "${BASH_REMATCH[3]}"
  return 0
}

command_words() { # text -> its first two words, skipping VAR=value assignments
  local w n=0
  local -a words
  read -r -a words <<<"$1"
  for w in "${words[@]}"; do
    [[ $w =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] && continue
    printf '%s\n' "$w"
    n=$((n + 1))
    [ "$n" -lt 2 ] || break
  done
}

is_gateway_server() { # a command that starts a gateway and keeps running
  local words w1 w2
  words=$(command_words "$1")
  w1=$(sed -n 1p <<<"$words")
  w2=$(sed -n 2p <<<"$words")
  case $1 in *" --help"* | *" -h "* | *" -h" | *" --version"* | *" -V"* | *" migrate"* | *" cleanup"*) return 1 ;; esac
  if [ "$w1" = cargo ] && [ "$w2" = run ]; then
    case $1 in *strata-gateway*) return 0 ;; esac
    return 1
  fi
  case $w1 in *strata-gateway) return 0 ;; esac
  return 1
}

is_background() { # ends with a single `&` (a trailing comment allowed)
  local t
  t=$(sed -e 's/[[:space:]]#[^"'"'"']*$//' <<<"$1" | tail -n1)
  t=$(trim "$t")
  [[ $t == *'&' && $t != *'&&' ]]
}

parse_block() { # block-file example-dir: writes k.cmd, k.kind, k.exp, k.rerun; "ncmds"; or "error"
  local file=$1 dir=$2 prompt=0 n=0 i=0 line text k=0 kind lang
  local -a L
  mapfile -t L <"$file"
  n=${#L[@]}
  lang=$(cat "${file%.txt}.lang")
  case $lang in
    indented | fenced: | fenced:sh | fenced:bash | fenced:shell | fenced:console | fenced:zsh) ;;
    *)
      echo "a ${lang#fenced:} block: this script only knows how to run shell blocks; teach it (scripts/readme-examples.sh)" >"$dir/error"
      return 1
      ;;
  esac
  if grep -q '^\$ ' "$file"; then prompt=1; fi
  while [ "$i" -lt "$n" ]; do
    line=${L[$i]}
    i=$((i + 1))
    [ -z "$(trim "$line")" ] && continue
    if { [ "$prompt" = 1 ] && [[ $line != '$ '* ]]; } || { [ "$prompt" = 0 ] && is_output_line "$line"; }; then
      if [ "$k" = 0 ]; then
        echo "output shown before any command: $line" >"$dir/error"
        return 1
      fi
      printf '%s\n' "$(trim "$line")" >>"$dir/$k.exp"
      continue
    fi
    if [ "$prompt" = 0 ] && [[ $(trim "$line") == '#'* ]]; then
      text=$(trim "$line")
      text=$(trim "${text#\#}")
      case $text in
        '{'* | '['*)
          if [ "$k" = 0 ]; then
            echo "expected output shown before any command: $line" >"$dir/error"
            return 1
          fi
          split_fragment "$text" || {
            echo "cannot read the expected output in: $line" >"$dir/error"
            return 1
          }
          printf '%s\n' "$FRAG" >>"$dir/$k.exp"
          if [ -n "$PROSE" ]; then
            prose_reruns "$PROSE" >"$dir/$k.rerun" || {
              echo "cannot check the README's claim \"$PROSE\"; teach scripts/readme-examples.sh how" >"$dir/error"
              return 1
            }
          fi
          ;;
      esac
      continue
    fi
    text=${line#'$ '}
    # A trailing backslash continues the command (bash -n accepts one at the end of its input).
    while { [[ $text == *'\' ]] || ! bash -n <<<"$text" 2>/dev/null; } && [ "$i" -lt "$n" ]; do
      line=${L[$i]}
      i=$((i + 1))
      [ "$prompt" = 1 ] && line=${line#'> '}
      text+=$'\n'"$line"
    done
    if ! bash -n <<<"$text" 2>/dev/null; then
      echo "not valid shell: $(head -n1 <<<"$text")" >"$dir/error"
      return 1
    fi
    case $text in
      *scripts/test.sh* | *readme-examples.sh*)
        echo "runs the test command (would recurse): $(head -n1 <<<"$text")" >"$dir/error"
        return 1
        ;;
    esac
    k=$((k + 1))
    printf '%s\n' "$text" >"$dir/$k.cmd"
    kind=fg
    if is_gateway_server "$text"; then
      if is_background "$text"; then kind=server-bg; else kind=server-fg; fi
    elif is_background "$text"; then
      kind=bg
    fi
    echo "$kind" >"$dir/$k.kind"
  done
  echo "$k" >"$dir/ncmds"
  if [ "$k" = 0 ]; then
    echo "no command in the block" >"$dir/error"
    return 1
  fi
}

# ---------------------------------------------------------------------------------------------
# Running.

port_in_use() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

redis_answers() { # host port: PING -> +PONG within 3 s
  local reply=""
  {
    exec 3<>"/dev/tcp/$1/$2" || return 1
    printf 'PING\r\n' >&3
    IFS= read -r -t 3 reply <&3 || true
    exec 3>&-
  } 2>/dev/null
  [[ $reply == +PONG* ]]
}

server_info() { # command-text -> "host port mode data-dir redis-host:port"
  local t=$1 listen data db redis host port mode rhp=""
  listen=$(arg_value "$t" --listen)
  [ -n "$listen" ] || listen=$(sed -n 's/.*STRATA_LISTEN=\([^[:space:]]*\).*/\1/p' <<<"$t" | head -n1)
  [ -n "$listen" ] || listen=$DEFAULT_LISTEN
  host=${listen%:*}
  port=${listen##*:}
  case $host in '' | 0.0.0.0 | '[::]' | localhost) host=127.0.0.1 ;; esac
  mode=run
  [ "$(command_words "$t" | head -n1)" = cargo ] && mode=build
  db=$(arg_value "$t" --database-url)
  data=$(arg_value "$t" --data-dir)
  [ -n "$data" ] || data=$DEFAULT_DATA_DIR
  case $db in '' | sqlite:*) ;; *) data="" ;; esac
  redis=$(arg_value "$t" --redis-url)
  if [ -n "$redis" ]; then
    rhp=${redis#*://}
    rhp=${rhp##*@}
    rhp=${rhp%%/*}
    [[ $rhp == *:* ]] || rhp="$rhp:6379"
  fi
  printf '%s %s %s %s %s\n' "$host" "$port" "$mode" "${data:--}" "${rhp:--}"
}

emit_steps() { # src-dir dst-dir id-prefix mode -> runner code for the parsed block in src-dir
  local src=$1 dst=$2 pre=$3 mode=$4 k n id kind text info host port smode data rhp r
  n=$(cat "$src/ncmds")
  for ((k = 1; k <= n; k++)); do
    id=$pre$k
    [ "$src" = "$dst" ] || cp "$src/$k.cmd" "$dst/$id.cmd"
    text=$(cat "$src/$k.cmd")
    kind=$(cat "$src/$k.kind")
    printf '__step %q\n' "$id"
    case $kind in
      server-fg)
        printf '{\n%s\n} >"$__EX/%s.out" 2>"$__EX/%s.err" </dev/null &\n' "$text" "$id" "$id"
        ;;
      *)
        printf '{\n%s\n} >"$__EX/%s.out" 2>"$__EX/%s.err" </dev/null\n' "$text" "$id" "$id"
        ;;
    esac
    case $kind in server-* | bg) printf '__BG+=(%q:"$!")\n' "$id" ;; esac
    case $kind in
      server-*)
        read -r host port smode data rhp <<<"$(server_info "$text")"
        [ "$data" = - ] && data=""
        if [[ $data =~ ^\$[A-Za-z_][A-Za-z0-9_]*$ ]]; then
          # A shell variable the README set (e.g. `dir=$(mktemp -d)`): expanded where it runs.
          printf '__ready %q %q %q "$!" %q "%s"\n' "$id" "$host" "$port" "$smode" "$data"
        else
          printf '__ready %q %q %q "$!" %q %q\n' "$id" "$host" "$port" "$smode" "$data"
        fi
        ;;
      bg) ;;
      fg)
        printf '__check_rc %q "$?"\n' "$id"
        if [ -s "$src/$k.exp" ]; then
          printf '__expect %q "" %q' "$id" "$mode"
          while IFS= read -r r; do printf ' %q' "$r"; done <"$src/$k.exp"
          printf '\n'
        else
          printf '__no_errors %q\n' "$id"
        fi
        if [ -s "$src/$k.rerun" ]; then
          local j=0
          while IFS= read -r r; do
            j=$((j + 1))
            printf '__step %q\n' "$id.r$j"
            printf '{\n%s\n} >"$__EX/%s.r%s.out" 2>"$__EX/%s.r%s.err" </dev/null\n' "$text" "$id" "$j" "$id" "$j"
            printf '__check_rc %q "$?"\n' "$id.r$j"
            printf '__expect %q %q %q %q\n' "$id.r$j" " (repeat $j, README: next requests)" "$mode" "$r"
          done <"$src/$k.rerun"
        fi
        ;;
    esac
  done
}

write_runner() { # example-dir steps-code
  local dir=$1
  {
    echo '#!/usr/bin/env bash'
    printf '__EX=%q\n__SCRATCH=%q\n__REPO=%q\n' "$dir" "$SCRATCH" "$REPO"
    printf '__BUILD_TIMEOUT=%q\n__READY_TIMEOUT=%q\n__DATA_TIMEOUT=%q\n' "$BUILD_TIMEOUT" "$READY_TIMEOUT" "$DATA_TIMEOUT"
    echo 'echo "$$" >"$__EX/pgid"'
    echo '__BG=()'
    declare -f "${RUNNER_HELPERS[@]}"
    cat <<'EOF'
# The reader's shell: no STRATA_* settings leaking in, localhost never through a proxy, and cargo
# acting on this checkout as if run from its root (the working directory stays the scratch one).
for __v in $(compgen -e); do case $__v in STRATA_*) unset "$__v" ;; esac; done
export NO_PROXY="localhost,127.0.0.1${NO_PROXY:+,$NO_PROXY}" no_proxy="localhost,127.0.0.1${no_proxy:+,$no_proxy}"
cargo() {
  local args=()
  for a in "$@"; do
    # The debug profile reuses what the test command built (see the runner's header).
    if [ "$a" = --release ] && [ "$README_EXAMPLES_PROFILE" = debug ]; then continue; fi
    args+=("$a")
  done
  if [ ${#args[@]} -gt 0 ] && [[ ${args[0]} != -* ]]; then
    command cargo "${args[0]}" --manifest-path "$__REPO/Cargo.toml" "${args[@]:1}"
  else
    command cargo "${args[@]}"
  fi
}
cd "$__SCRATCH" || __fail "cannot enter the scratch directory $__SCRATCH"
EOF
    cat
    echo 'exit 0'
  } >"$dir/run.sh"
}

run_runner() { # example-dir deadline-seconds -> RUN_WHY: "" or why it failed
  local dir=$1 deadline=$2 rp end timed_out=0 rc=0 pgid
  RUN_WHY=""
  setsid -w bash "$dir/run.sh" </dev/null >"$dir/runner.log" 2>&1 &
  rp=$!
  runner_pgid=$rp
  end=$((SECONDS + deadline))
  while kill -0 "$rp" 2>/dev/null; do
    if [ "$SECONDS" -ge "$end" ]; then
      timed_out=1
      break
    fi
    sleep 0.2
  done
  pgid=$(cat "$dir/pgid" 2>/dev/null || echo "$rp")
  runner_pgid=$pgid
  if [ "$timed_out" = 1 ]; then
    stop_group "$pgid" || true
    wait "$rp" 2>/dev/null || true
    runner_pgid=""
    local step
    step=$(cat "$dir/step" 2>/dev/null || echo '?')
    RUN_WHY="timed out after ${deadline}s in \`$(head -n1 "$dir/${step%%.r*}.cmd" 2>/dev/null)\`"
    return 0
  fi
  wait "$rp" || rc=$?
  if [ -s "$dir/fail" ]; then
    RUN_WHY=$(trim "$(cat "$dir/fail")")
  elif [ "$rc" -ne 0 ]; then
    RUN_WHY="runner exited with status $rc: $(tail -n3 "$dir/runner.log" | tr '\n' ' ')"
  fi
  return 0
}

# ---------------------------------------------------------------------------------------------

for tool in curl awk setsid flock realpath; do
  command -v "$tool" >/dev/null 2>&1 || {
    add_result "prerequisites" "$tool is not installed" 1
    finish
  }
done

exec 9>"$LOCK"
if ! flock -w 900 9; then
  add_result "lock" "another run holds $LOCK (the README's ports and /tmp paths are machine-wide) for over 900s" 1
  finish
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-readme-run.XXXXXX")
SCRATCH=$WORK/reader
mkdir -p "$SCRATCH/target" "$WORK/blocks" "$WORK/examples" "$WORK/tmp"
# Temporary directories the README makes (`mktemp -d`) live in the scratch and go with it.
export TMPDIR=$WORK/tmp
# The README runs `target/release/strata-gateway`: give the reader's directory that layout,
# pointing at where cargo builds the profile run. The repository's own `target/` is left alone.
ln -s "$CARGO_TARGET_DIR/$PROFILE" "$SCRATCH/target/release"

status=0
extract_blocks "$README" "$WORK/blocks" || status=$?
if [ "$status" -ne 0 ]; then
  add_result "README" "no \"## Run\" section in $README (awk status $status)" 1
  finish
fi
mapfile -t block_files < <(find "$WORK/blocks" -name '*.txt' | sort)
if [ "${#block_files[@]}" -eq 0 ]; then
  add_result "README" "no example blocks under \"## Run\"" 1
  finish
fi
DEFAULT_LISTEN=$(table_default --listen)
DEFAULT_DATA_DIR=$(table_default --data-dir)
if [ -z "$DEFAULT_LISTEN" ] || [ -z "$DEFAULT_DATA_DIR" ]; then
  add_result "README" "cannot read the defaults of --listen / --data-dir from the settings table" 1
  finish
fi

CARGO_RE='(^|[[:space:];&|(])cargo[[:space:]]'
declare -A client_for_port=() # port -> example dir of the latest block that sent requests to it
declare -A per_heading=()

for bf in "${block_files[@]}"; do
  head_title=$(cat "${bf%.txt}.head")
  per_heading[$head_title]=$((${per_heading[$head_title]:-0} + 1))
  idx=${#names[@]}
  ex=$WORK/examples/$(printf '%02d' "$((idx + 1))")
  mkdir -p "$ex"
  first=$(grep -v '^[[:space:]]*$' "$bf" | head -n1 | tr -s ' ' | sed 's/[[:space:]]*\\$//')
  ncmd_lines=$(grep -cv '^[[:space:]]*$' "$bf" || true)
  label="$head_title#${per_heading[$head_title]} (\`$first\`$([ "$ncmd_lines" -le 1 ] || echo ' ...'))"

  if ! parse_block "$bf" "$ex"; then
    add_result "$label" "$(cat "$ex/error")" 1
    continue
  fi
  n=$(cat "$ex/ncmds")
  servers=()
  has_cargo=0
  sleeps=0
  client_ports=()
  for ((k = 1; k <= n; k++)); do
    text=$(cat "$ex/$k.cmd")
    [[ $text =~ $CARGO_RE ]] && has_cargo=1
    while read -r s; do [ -n "$s" ] && sleeps=$((sleeps + ${s%.*})); done < <(grep -oE '(^|[[:space:];])sleep[[:space:]]+[0-9.]+' <<<"$text" | grep -oE '[0-9.]+$' || true)
    case $(cat "$ex/$k.kind") in
      server-*) servers+=("$(server_info "$text")") ;;
      *) while read -r p; do [ -n "$p" ] && client_ports+=("$p"); done < <(grep -oE '(localhost|127\.0\.0\.1):[0-9]+' <<<"$text" | sed 's/.*://' || true) ;;
    esac
  done

  # A block that starts a gateway ends the previous gateways (as a reader would stop them first).
  [ "${#servers[@]}" -gt 0 ] && stop_sessions
  add_result "$label" ok 0

  # Preconditions: free ports, Redis answering, README data dirs that start out clean.
  pre=""
  declare -A seen_dir=()
  for s in "${servers[@]}"; do
    read -r host port smode data rhp <<<"$s"
    if port_in_use "$host" "$port"; then
      pre="port $host:$port is already in use by another process; the README's example needs it"
      break
    fi
    if [ "$rhp" != - ] && ! redis_answers "${rhp%:*}" "${rhp##*:}"; then
      pre="no Redis answering PING on ${rhp} (./scripts/test.sh starts one): the README's Redis example cannot run"
      break
    fi
    if [[ $data == /* ]] && [ -z "${seen_dir[$data]:-}" ]; then
      seen_dir[$data]=1
      if [ -e "$data" ]; then
        pre="$data already exists (an earlier run?): the README's example would reuse its counts; remove it and rerun"
        break
      fi
      created_dirs+=("$data")
    fi
  done
  unset seen_dir
  if [ -n "$pre" ]; then
    fail_result "$idx" "$pre"
    final[$idx]=1
    flush_results
    continue
  fi

  steps=$(emit_steps "$ex" "$ex" "" exact)
  # A block that only starts a gateway: send it the requests of the latest block aimed at its port.
  replay_from=""
  if [ "${#servers[@]}" -gt 0 ] && [ "${#client_ports[@]}" -eq 0 ]; then
    read -r _ port _ <<<"${servers[-1]}"
    replay_from=${client_for_port[$port]:-}
    [ -n "$replay_from" ] && steps+=$'\n'$(emit_steps "$replay_from" "$ex" c relaxed)
  fi
  write_runner "$ex" <<<"$steps"

  deadline=$((STEP_SLACK + sleeps + ${#servers[@]} * (READY_TIMEOUT + DATA_TIMEOUT)))
  [ "$has_cargo" = 1 ] && deadline=$((deadline + BUILD_TIMEOUT))
  [ -n "$replay_from" ] && deadline=$((deadline + STEP_SLACK))
  run_runner "$ex" "$deadline"
  pgid=$(cat "$ex/pgid" 2>/dev/null || echo "")
  runner_pgid=""
  [ -n "$RUN_WHY" ] && fail_result "$idx" "$RUN_WHY (logs: $ex)"

  if [ "${#servers[@]}" -gt 0 ] && [ -n "$pgid" ]; then
    sessions+=("$pgid:$idx")
  else
    [ -n "$pgid" ] && { stop_group "$pgid" || true; }
    final[$idx]=1
  fi
  if [ "${#servers[@]}" -eq 0 ]; then
    for p in "${client_ports[@]}"; do client_for_port[$p]=$ex; done
  fi
  flush_results
done

stop_sessions
finish
