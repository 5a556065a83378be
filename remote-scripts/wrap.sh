#!/bin/sh
# Waymark remote wrapper, protocol 1.
#
# The wire protocol (verbs, output blocks, exit codes, marker layout) is
# specified in PROTOCOL.md beside this file; change the two together.  The
# client embeds this file and installs it as <remote_dir>/bin/wrap-<hash>, so
# any edit is a new wrapper version on every host.
#
# Portability: strict POSIX sh (dash, bash, busybox ash) plus setsid, head -c
# and Linux /proc.  Every exec counts on the `run` path (about a millisecond
# each): prefer builtins, read files with `read`, never call `date`, and write
# records with one builtin `printf` rather than temp file + mv (see rec).

set -f
IFS=' 	
'
# The wrapper's own programs (mkdir, setsid, sleep, wc, head, ...) run in the
# C locale: where PAM sets LANG, each would otherwise load the locale's files
# (~0.3-0.5 ms apiece).  The caller's LC_ALL travels to the supervisor in
# WAYMARK_WRAP_LC_ALL (`-` for unset, `=VALUE` for set) and launch gives it
# back to the command.
if [ -z "${WAYMARK_WRAP_LC_ALL-}" ]; then
	WAYMARK_WRAP_LC_ALL=-
	[ -z "${LC_ALL+x}" ] || WAYMARK_WRAP_LC_ALL="=$LC_ALL"
	export WAYMARK_WRAP_LC_ALL
fi
LC_ALL=C
export LC_ALL

P=waymark-wrap/1
SP=waymark-serve/1
# Set in a `serve` worker: requests come on stdin, one per line.
SERVING=
# A run's --boundary (parse_opts); empty for a verb without one.
O_BOUNDARY=
X_USAGE=64
X_EXISTS=65
X_NOID=66
X_INTERNAL=70
INLINE_DEFAULT=65536
GRACE_DEFAULT=5
START_GRACE_MS=30000
# Seconds from the first look of a `watch` at its streams to the next (each
# quiet look doubles it, up to 1).
WATCH_TICK=0.25
ID_CHARS=0123456789ABCDEFGHJKMNPQRSTVWXYZ
NAME_CHARS=ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_
NL='
'
# shellcheck disable=SC2034 # read by the eval in serve_one
Q=\'
# The interpreter used to start the supervisor; `busybox sh` is two words.
SH=${WAYMARK_SH:-sh}

fail() {
	_c=$1
	shift
	printf 'waymark-wrap: %s\n' "$*" >&2
	exit "$_c"
}

usage() {
	fail "$X_USAGE" "$@"
}

# ---------------------------------------------------------------- paths

if [ -n "${WAYMARK_REMOTE_DIR:-}" ]; then
	R=$WAYMARK_REMOTE_DIR
else
	# Installed as <remote_dir>/bin/wrap-<hash>: remote_dir is two levels up.
	case $0 in
	*/*) R=${0%/*} ;;
	*) R=. ;;
	esac
	case $R in
	*/*) R=${R%/*} ;;
	*) R=$R/.. ;;
	esac
	R=${R:-/}
fi
case $R in
/*) ;;
*) R=$(cd -- "$R" 2>/dev/null && pwd) || fail "$X_INTERNAL" "remote dir not found" ;;
esac
E=$R/exec

# ---------------------------------------------------------------- helpers

valid_id() {
	case $1 in
	act_??????????????????????????) ;;
	*) return 1 ;;
	esac
	case ${1#act_} in
	*[!$ID_CHARS]*) return 1 ;;
	esac
	return 0
}

isnum() {
	case $1 in
	'' | *[!0123456789]*) return 1 ;;
	esac
	[ ${#1} -le 15 ]
}

# valid_boundary WORD: 16 to 64 characters of 0-9a-f (the caller's random
# pick, which ends bytes on a serve channel: see output and print_run).
valid_boundary() {
	case $1 in
	'' | *[!0123456789abcdef]*) return 1 ;;
	esac
	case ${#1} in
	1[6789] | [2345][0-9] | 6[01234]) return 0 ;;
	esac
	return 1
}

# uint VALUE LABEL: sets N to VALUE without leading zeros (which $(( ))
# would read as octal), or exits with a usage error.
uint() {
	isnum "$1" || usage "$2 must be a non-negative integer, got '$1'"
	N=${1#"${1%%[!0]*}"}
	N=${N:-0}
}

nap() {
	sleep 0.1 2>/dev/null || sleep 1
}

# rec FILE FIELDS: writes a one-line record ending in ` .`.  Every reader
# checks that last field, so a record being written (or torn by a crash) reads
# as not there yet: as atomic as temp file + mv, without forking mv.
rec() {
	printf '%s .\n' "$2" >"$1"
}

# clock: sets BOOT (kernel boot id) and NOW (Unix time in milliseconds)
# without forking: boot time (cached per boot in $R/clock) + /proc/uptime.
BOOT=
BTIME=
clock() {
	[ -n "$BOOT" ] || read -r BOOT </proc/sys/kernel/random/boot_id
	if [ -z "$BTIME" ]; then
		_b=
		{ read -r _b _t _z <"$R/clock"; } 2>/dev/null
		if [ "$_b" = "$BOOT" ] && [ "$_z" = . ] && isnum "$_t"; then
			BTIME=$_t
		else
			_t=$(sed -n 's/^btime //p' /proc/stat)
			isnum "$_t" || fail "$X_INTERNAL" "cannot read boot time from /proc/stat"
			BTIME=$_t
			{ rec "$R/clock" "$BOOT $BTIME"; } 2>/dev/null
		fi
	fi
	read -r _u _ </proc/uptime
	_f=${_u#*.}00
	_f=${_f%"${_f#??}"}
	_f=${_f#0}
	NOW=$(((BTIME + ${_u%.*}) * 1000 + _f * 10))
}

# pstart PID|self: sets PID and PS (start time in clock ticks since boot,
# field 22 of /proc/PID/stat); fails when the process is gone or a zombie.
pstart() {
	PS=
	PID=
	{ read -r _l <"/proc/$1/stat"; } 2>/dev/null || return 1
	PID=${_l%% *}
	# The command name (field 2) may hold spaces and ')': cut at the last ')'.
	_l=${_l##*\)}
	# shellcheck disable=SC2086
	set -- $_l
	case $1 in
	Z | X | x) return 1 ;;
	esac
	[ $# -ge 20 ] || return 1
	shift 19
	PS=$1
}

# alive PID START BOOT: the process that was PID at START in boot BOOT
# still runs.  A reused pid or a reboot never passes.
alive() {
	[ "$3" = "$BOOT" ] && pstart "$1" && [ "$PS" = "$2" ]
}

# kill_group SIG PGID START: signal the command's process group, unless the
# leader's pid now belongs to an unrelated process.
kill_group() {
	if pstart "$2" && [ "$PS" != "$3" ]; then
		return 1
	fi
	kill -"$1" -"$2" 2>/dev/null
}

# drain_group PGID START GRACE: wait up to GRACE seconds for the group to
# vanish, then KILL what is left and wait for it to go.
drain_group() {
	_n=$(($3 * 10))
	while [ "$_n" -gt 0 ] && kill -0 -"$1" 2>/dev/null; do
		nap
		_n=$((_n - 1))
	done
	kill_group KILL "$1" "$2" || return 0
	_n=30
	while [ "$_n" -gt 0 ] && kill -0 -"$1" 2>/dev/null; do
		nap
		_n=$((_n - 1))
	done
}

# fsize FILE: sets FS to the size of FILE in bytes (0 when missing).
fsize() {
	FS=0
	[ -s "$1" ] || return 0
	FS=$(wc -c <"$1") || FS=0
	FS=$((FS))
}

# marker ID: M, the marker of ID (a file whose exclusive creation claimed the
# ID), MF, the file holding its meta record, and F, the prefix of its other
# files (M.sup, M.exit, ...).  A wrapper before layout 2 made the marker a
# directory holding meta, sup, exit, ...: such a marker is read there.
marker() {
	M=$E/$1
	F=$M.
	MF=$M
	[ ! -d "$M" ] || F=$M/ MF=$M/meta
}

# claim: creates the marker $M with its meta record, failing when it exists.
# Under noclobber (`set -C`) dash, bash and busybox ash open a missing file
# with O_CREAT|O_EXCL: the one atomic step that refuses a second start, with
# no process forked (a `mkdir` cost a fork, an exec and a directory).
claim() {
	set -C
	{ printf 'v1 %s %s %s %s .\n' "$NOW" "${O_TIMEOUT:--}" "$O_GRACE" "$O_STDIN" >"$M"; } 2>/dev/null
	_c=$?
	set +C
	return "$_c"
}

ensure_exec_dir() {
	[ -d "$E" ] || (umask 077 && mkdir -p "$E") ||
		fail "$X_INTERNAL" "cannot create $E"
}

# sup_running: the supervisor of marker $M is alive (call clock first).
sup_running() {
	_z=
	{ read -r _p _s _b _ _z <"${F}sup"; } 2>/dev/null
	[ "$_z" = . ] && alive "$_p" "$_s" "$_b"
}

# wait_sup: until the supervisor of marker $M is gone.  Polls, backing off to
# half a second: `run` never comes here (it waits for its own child), only
# `wait` and `cancel` do.
wait_sup() {
	_t=0.05
	while sup_running; do
		sleep "$_t" 2>/dev/null || sleep 1
		case $_t in
		0.05) _t=0.1 ;;
		0.1) _t=0.2 ;;
		*) _t=0.5 ;;
		esac
	done
}

# ---------------------------------------------------------------- options

# parse_opts MODE ARGS...: validates the options of start/run (MODE start,
# run or sup) up to `--`; sets O_* and O_NOPT (arguments before the argv).
parse_opts() {
	_mode=$1
	shift
	O_TIMEOUT=
	O_GRACE=$GRACE_DEFAULT
	O_CWD=
	O_HAS_CWD=0
	O_STDIN=0
	O_INLINE=$INLINE_DEFAULT
	O_ENVN=
	O_SENV=
	O_BOUNDARY=
	O_NOPT=0
	while :; do
		[ $# -gt 0 ] || usage "missing '--' before the command"
		O_NOPT=$((O_NOPT + 1))
		case $1 in
		--)
			shift
			break
			;;
		--stdin)
			[ -z "$SERVING" ] || usage "--stdin is not served: send it on an exec channel"
			O_STDIN=1
			shift
			continue
			;;
		--timeout | --grace | --cwd | --env | --secret-env | --inline-max | --boundary)
			[ $# -ge 2 ] || usage "$1 needs a value"
			O_NOPT=$((O_NOPT + 1))
			;;
		*) usage "unknown option: $1" ;;
		esac
		case $1 in
		--timeout)
			uint "$2" --timeout
			[ "$N" -gt 0 ] || usage "--timeout must be at least 1"
			O_TIMEOUT=$N
			;;
		--grace)
			uint "$2" --grace
			O_GRACE=$N
			;;
		--cwd)
			[ -n "$2" ] || usage "--cwd must not be empty"
			O_CWD=$2
			O_HAS_CWD=1
			;;
		--env)
			case $2 in
			*=*) ;;
			*) usage "--env needs NAME=VALUE" ;;
			esac
			_k=${2%%=*}
			case $_k in
			'' | [0123456789]* | *[!$NAME_CHARS]*) usage "invalid environment variable name: $_k" ;;
			esac
			O_ENVN="$O_ENVN $_k"
			;;
		--secret-env)
			[ -z "$SERVING" ] || usage "--secret-env is not served: send it on an exec channel"
			uint "$2" --secret-env
			O_SENV=$N
			;;
		--inline-max)
			[ "$_mode" != start ] || usage "--inline-max applies to run only"
			uint "$2" --inline-max
			O_INLINE=$N
			;;
		--boundary)
			[ "$_mode" != start ] || usage "--boundary applies to run only"
			valid_boundary "$2" || usage "invalid boundary: $2"
			O_BOUNDARY=$2
			;;
		esac
		shift 2
	done
	[ $# -gt 0 ] || usage "missing command after '--'"
	# On a serve channel the inline bytes must never put the channel out of
	# step (see print_run).
	[ "$_mode" != run ] || [ -z "$SERVING" ] || [ -n "$O_BOUNDARY" ] ||
		usage "a served run needs --boundary"
}

# ---------------------------------------------------------------- supervisor

# read_cmd: the command record of $M into S_cmd and _cs.
read_cmd() {
	_z=
	{ read -r S_cmd _cs _z <"${F}cmd"; } 2>/dev/null
	[ "$_z" = . ] || S_cmd='' _cs=''
}

# The command process: runs in the supervisor's foreground, records itself,
# then becomes the command (setsid: own session and process group).
launch() {
	trap - HUP
	# A PATH given with --env applies to the command, not to finding setsid.
	_waymark_setsid=setsid
	for _a in "$@"; do
		case $_a in
		--) break ;;
		PATH=*) _waymark_setsid=$(command -v setsid) || exit 127 ;;
		esac
	done
	if [ "$O_HAS_CWD" = 1 ]; then
		CDPATH='' cd -- "$O_CWD" 2>/dev/null || {
			printf 'waymark-wrap: cannot change directory to %s\n' "$O_CWD" >&2
			exit 126
		}
	fi
	[ ! -e "${F}cancel" ] || exit 0
	case $WAYMARK_WRAP_LC_ALL in
	=*) LC_ALL=${WAYMARK_WRAP_LC_ALL#=} ;;
	*) unset LC_ALL ;;
	esac
	unset WAYMARK_WRAP_LC_ALL
	pstart self || exit 125
	rec "${F}cmd" "$PID $PS" || exit 125
	if [ "$SUP_MODE" = start ]; then
		# The starter may be gone (dropped session): never die of SIGPIPE here.
		trap '' PIPE
		printf 'p\n' >&4 2>/dev/null
		trap - PIPE
		exec 4>&-
	fi
	# Exports come last: an exported IFS, M or PATH must not change the
	# wrapper's own work.
	while [ "$1" != -- ]; do
		case $1 in
		--env)
			export "${2?}"
			shift 2
			;;
		--stdin) shift ;;
		*) shift 2 ;;
		esac
	done
	shift
	# The --secret-env block came on stdin and reached us in the environment,
	# never on a command line.
	_se=${WAYMARK_WRAP_SECRET_ENV-}
	unset WAYMARK_WRAP_SECRET_ENV
	_sa=
	while [ -n "$_se" ]; do
		_l=${_se%%"$NL"*}
		case $_se in
		*"$NL"*) _se=${_se#*"$NL"} ;;
		*) _se= ;;
		esac
		case $_l in
		'') ;;
		@*=*)
			# A secret argv word: kept in a shell variable, not exported.
			_k=${_l%%=*}
			_k=${_k#@}
			case $_k in
			'' | 0* | *[!0123456789]*) exit 125 ;;
			esac
			eval "_waymark_sarg_$_k=\${_l#*=}"
			_sa="$_sa $_k"
			;;
		*) export "${_l?}" ;;
		esac
	done
	if [ -n "$_sa" ]; then
		# Put each secret word in its place, just before becoming the command.
		_n=$#
		_i=1
		while [ "$_i" -le "$_n" ]; do
			eval "_a=\${_waymark_sarg_$_i-\$1}"
			unset "_waymark_sarg_$_i"
			shift
			set -- "$@" "$_a"
			_i=$((_i + 1))
		done
		unset _a _sa
	fi
	# After the --env exports: the command's own id is not the caller's to set.
	WAYMARK_EXECUTION_ID=$S_id
	export WAYMARK_EXECUTION_ID
	exec "$_waymark_setsid" -- "$@"
}

# timer: the fallback for a supervisor whose deadline the timekeeper could not
# take (see due): a subshell that sleeps out the timeout, then ends the command.
timer() {
	_s=
	trap '[ -z "$_s" ] || kill "$_s" 2>/dev/null; exit 0' TERM
	sleep "$O_TIMEOUT" &
	_s=$!
	wait "$_s"
	trap '' TERM
	clock
	rec "${F}timed_out" "$NOW"
	time_out "$O_GRACE"
}

# time_out GRACE: the timeout of marker $M fired: SIGTERM to the command's
# process group (once it is recorded), SIGKILL to what is left after GRACE.
time_out() {
	_n=0
	until read_cmd && [ -n "$S_cmd" ]; do
		[ "$_n" -lt 50 ] || return 0
		_n=$((_n + 1))
		nap
	done
	kill_group TERM "$S_cmd" "$_cs"
	drain_group "$S_cmd" "$_cs" "$1"
}

# ---------------------------------------------------------------- timeouts
#
# One timekeeper per remote dir enforces every --timeout, so an action with a
# timeout starts no timer process of its own (a subshell and a `sleep` were a
# third of what a served `run` cost the host).  A supervisor appends its ID to
# exec/.due/SECOND, the Unix second its timeout is due (rounded up), and makes
# sure a timekeeper runs.  The timekeeper wakes every second, fires each due
# ID that has not ended, removes the files it went through, and exits once
# none is left.  A timeout fires within about a second after it is due.

# due ID: hands ID's timeout to the timekeeper; fails (the supervisor then
# starts its own timer) when it could not.
due() {
	clock
	_sec=$(((NOW + 999) / 1000 + O_TIMEOUT))
	{ printf '%s\n' "$1" >>"$E/.due/$_sec"; } 2>/dev/null ||
		{ mkdir -p "$E/.due" && printf '%s\n' "$1" >>"$E/.due/$_sec"; } 2>/dev/null ||
		return 1
	# The timekeeper reads second _sec only once its clock has reached it: an
	# append done while ours had not is seen.  Later (this process stalled for
	# the whole timeout), it may have been read and removed already.
	clock
	[ $((NOW / 1000)) -lt "$_sec" ] || return 1
	keeper_runs
}

# keeper_runs: a timekeeper runs for this remote dir, or one is started.
keeper_runs() {
	[ -d "$E/.due" ] || return 1
	_z=
	{ read -r _p _s _b _z <"$E/.due/.keeper"; } 2>/dev/null
	[ "$_z" = . ] && alive "$_p" "$_s" "$_b" && return 0
	# setsid in place (a child of this shell leads no group): its own
	# session, out of reach of the SSH session's process group.
	# shellcheck disable=SC2086
	setsid $SH "$0" _keep </dev/null >/dev/null 2>"$E/.due/.keeper.log" 4>&- &
	pstart "$!" || return 1
	rec "$E/.due/.keeper" "$PID $PS $BOOT"
}

# keeper: the timekeeper.  Runs while its record in .due/.keeper names it; lets
# go of it when nothing is left to time, then looks once more, for a
# supervisor that appended while it still saw this timekeeper run.
keeper() {
	trap '' HUP
	# Relative names from here: a remote dir may hold spaces, a second never.
	cd "$E/.due" || exit 1
	pstart self || exit 1
	_me="$PID $PS"
	while :; do
		# Wake just past the next whole second: a due second is then gone
		# through at most a second after the timeout (rounded up) is due.
		clock
		_w=$((1020 - NOW % 1000))
		case $_w in
		?) _w=0.00$_w ;;
		??) _w=0.0$_w ;;
		???) _w=0.$_w ;;
		*) _w=1 ;;
		esac
		sleep "$_w" 2>/dev/null || sleep 1 || exit 1
		_z=
		{ read -r _p _s _ _z <.keeper; } 2>/dev/null
		[ "$_z" = . ] && [ "$_p $_s" = "$_me" ] || exit 0
		clock
		_now=$((NOW / 1000))
		_left=
		_gone=
		set +f
		for _f in [0123456789]*; do
			[ -e "$_f" ] || continue
			if isnum "$_f" && [ "$_f" -gt "$_now" ]; then
				_left=1
				continue
			fi
			while IFS= read -r _id; do
				! valid_id "$_id" || fire "$_id"
			done <"$_f"
			_gone="$_gone $_f"
		done
		set -f
		# shellcheck disable=SC2086
		[ -z "$_gone" ] || rm -f -- $_gone
		[ -z "$_left" ] || continue
		: >.keeper
		set +f
		for _f in [0123456789]*; do
			[ ! -e "$_f" ] || _left=1
			break
		done
		set -f
		[ -n "$_left" ] || exit 0
		rec .keeper "$_me $BOOT"
	done
}

# fire ID: ID's timeout is due.  Unless it ended, or was supervised before a
# reboot, flag it timed out (once: the flag is created exclusively) and end
# its process group in the background.
fire() {
	marker "$1"
	[ ! -e "${F}exit" ] || return 0
	_z=
	{ read -r _ _ _b _ _z <"${F}sup"; } 2>/dev/null
	[ "$_z" = . ] && [ "$_b" = "$BOOT" ] || return 0
	_z=
	{ read -r _ _ _ _g _ _z <"$MF"; } 2>/dev/null
	[ "$_z" = . ] && isnum "$_g" || _g=$GRACE_DEFAULT
	set -C
	{ rec "${F}timed_out" "$NOW"; } 2>/dev/null
	_c=$?
	set +C
	[ "$_c" = 0 ] || return 0
	time_out "$_g" &
}

supervise() {
	SUP_MODE=$1
	S_id=$2
	shift 2
	marker "$S_id"
	parse_opts sup "$@"
	trap '' HUP
	clock
	# /proc/self, not $$: under `serve` the supervisor is a subshell, and $$
	# would name the serve.
	pstart self || return "$X_INTERNAL"
	rec "${F}sup" "$PID $PS $BOOT $NOW" || return "$X_INTERNAL"
	if [ -e "${F}abandoned" ]; then
		# A status call already reported this marker as never launched.
		rm -f "${F}sup"
		return 0
	fi
	if [ -e "${F}cancel" ]; then
		rec "${F}exit" "- cancelled $NOW not_launched"
		return 0
	fi
	_tp=
	if [ -n "$O_TIMEOUT" ] && ! due "$S_id"; then
		timer </dev/null >/dev/null 4>&- &
		_tp=$!
	fi
	_in=/dev/null
	[ "$O_STDIN" = 0 ] || _in=${F}stdin
	(launch "$@") <"$_in" >"${F}stdout" 2>"${F}stderr"
	_ws=$?
	[ "$SUP_MODE" != start ] || exec 4>&-
	if [ -n "$_tp" ]; then
		kill -TERM "$_tp" 2>/dev/null
		wait "$_tp"
	fi
	_err=-
	read_cmd
	if [ -z "$S_cmd" ]; then
		_err=not_launched
		[ ! -e "${F}cancel" ] || _ws=-
	fi
	_r=exited
	_g=$O_GRACE
	if [ -e "${F}timed_out" ]; then
		_r=timed_out
	elif [ -e "${F}cancel" ]; then
		_r=cancelled
		{ read -r _ _g <"${F}cancel"; } 2>/dev/null
		isnum "$_g" || _g=$O_GRACE
	fi
	# Leave no process of a timed-out or cancelled command behind.
	[ "$_r" = exited ] || [ -z "$S_cmd" ] || drain_group "$S_cmd" "$_cs" "$_g"
	clock
	rec "${F}exit" "$_ws $_r $NOW $_err" || return "$X_INTERNAL"
}

# The supervisor is dispatched here, before the shell reads (and parses) the
# client-facing verbs below: it starts on the critical path of every `run`.
if [ "${1-}" = _sup ]; then
	shift
	supervise "$@"
	exit
fi

# ---------------------------------------------------------------- status

# read_exit: reads the exit record of $M into S_*; fails when there is none.
read_exit() {
	_w=
	_r=
	_f=
	_e=
	_z=
	{ read -r _w _r _f _e _z <"${F}exit"; } 2>/dev/null
	[ "$_z" = . ] && isnum "$_f" || return 1
	S_finished=$_f
	case $_r in
	timed_out | cancelled) S_state=$_r ;;
	*) S_state=completed ;;
	esac
	[ "$_e" = - ] || S_error=$_e
	if isnum "$_w"; then
		S_ws=$_w
		if [ "$_w" -gt 128 ] && [ "$_w" -le 192 ]; then
			S_sig=$((_w - 128))
		else
			S_exit=$_w
		fi
	fi
	S_launched=no
	[ ! -e "${F}cmd" ] || S_launched=yes
	return 0
}

# load_status ID: computes the state of marker ID into S_* (and M).
load_status() {
	S_id=$1
	marker "$1"
	S_state=absent
	S_launched=
	S_created=
	S_started=
	S_finished=
	S_sup=
	S_cmd=
	S_ws=
	S_exit=
	S_sig=
	S_timeout=
	S_cancel=no
	S_alive=
	S_error=
	S_out=0
	S_err=0
	[ -e "$M" ] || return 0
	clock
	_v=
	{ read -r _v _c _to _g _si _z <"$MF"; } 2>/dev/null
	if [ "$_v" = v1 ] && [ "$_z" = . ]; then
		S_created=$_c
		[ "$_to" = - ] || S_timeout=$_to
	fi
	read_cmd
	_z=
	{ read -r S_sup _ss _sb S_started _z <"${F}sup"; } 2>/dev/null
	[ "$_z" = . ] || S_sup='' S_started=''
	if read_exit; then
		:
	elif [ -n "$S_sup" ]; then
		if alive "$S_sup" "$_ss" "$_sb"; then
			S_state=running
			S_launched=unknown
			[ -z "$S_cmd" ] || S_launched=yes
		elif read_exit; then
			# It wrote its exit record between our two looks.
			read_cmd
		else
			S_state=interrupted
			S_launched=unknown
			S_alive=no
			if [ -n "$S_cmd" ]; then
				S_launched=yes
				! alive "$S_cmd" "$_cs" "$_sb" || S_alive=yes
			fi
		fi
	else
		# No supervisor record: the start is still on its way, or it died.
		if [ -e "${F}abandoned" ]; then
			_young=0
		elif [ -n "$S_created" ] && isnum "$S_created"; then
			_young=$((NOW - S_created < START_GRACE_MS))
		elif [ -n "$(find "$M" -prune -mmin -1)" ]; then
			_young=1
		else
			_young=0
		fi
		if [ "$_young" = 1 ]; then
			S_state=starting
			S_launched=no
		else
			# Fence off a late supervisor before saying "never launched": it
			# looks for this file after writing its record, so a record still
			# incomplete now belongs to a supervisor that will see the fence.
			[ -e "${F}abandoned" ] || rec "${F}abandoned" "$NOW" 2>/dev/null
			_z=
			{ read -r _ _ _ _ _z <"${F}sup"; } 2>/dev/null
			if [ "$_z" = . ]; then
				load_status "$1"
				return 0
			fi
			S_state=interrupted
			S_launched=no
			S_alive=no
		fi
	fi
	[ ! -e "${F}cancel" ] || S_cancel=yes
	fsize "${F}stdout"
	S_out=$FS
	fsize "${F}stderr"
	S_err=$FS
}

# print_status KIND: the status block, without its terminating blank line.
print_status() {
	printf '%s %s\nid=%s\nstate=%s\nlaunched=%s\ncreated_ms=%s\nstarted_ms=%s\nfinished_ms=%s\nsupervisor_pid=%s\ncommand_pid=%s\nwait_status=%s\nexit_code=%s\nsignal=%s\ntimeout_s=%s\ncancel_requested=%s\ncommand_alive=%s\nerror=%s\nstdout_bytes=%s\nstderr_bytes=%s\n' \
		"$P" "$1" "$S_id" "$S_state" "$S_launched" "$S_created" "$S_started" \
		"$S_finished" "$S_sup" "$S_cmd" "$S_ws" "$S_exit" "$S_sig" "$S_timeout" \
		"$S_cancel" "$S_alive" "$S_error" "$S_out" "$S_err"
}

# print_run INLINE_MAX: the run block of the marker load_status last read:
# status, inline sizes, blank line, then the inline bytes of stdout and then
# stderr.  With --boundary each inline stream's bytes end with a line
# `--BOUNDARY` after a newline: a stream cut shorter between its size and its
# read (a process the command left behind reopening /dev/stdout) gives fewer
# bytes, never a reply out of step on a serve channel.
print_run() {
	print_status run
	_io=-
	_ie=-
	[ "$S_out" -gt "$1" ] || _io=$S_out
	[ "$S_err" -gt "$1" ] || _ie=$S_err
	printf 'stdout_inline=%s\nstderr_inline=%s\n' "$_io" "$_ie"
	[ -z "$O_BOUNDARY" ] || printf 'boundary=%s\n' "$O_BOUNDARY"
	printf '\n'
	[ "$_io" = - ] || [ "$_io" = 0 ] || head -c "$_io" "${F}stdout"
	[ -z "$O_BOUNDARY" ] || [ "$_io" = - ] || printf '\n--%s\n' "$O_BOUNDARY"
	[ "$_ie" = - ] || [ "$_ie" = 0 ] || head -c "$_ie" "${F}stderr"
	[ -z "$O_BOUNDARY" ] || [ "$_ie" = - ] || printf '\n--%s\n' "$O_BOUNDARY"
}

refuse() {
	[ -z "$1" ] || rm -f "$1"
	load_status "$S_id"
	print_status status
	printf '\n'
	exit "$X_EXISTS"
}

# ---------------------------------------------------------------- verbs

# save_argv NOPT ARGS...: the argv after the options, NUL-terminated, after
# the meta record in the marker: every file a start creates costs an inode.
save_argv() {
	shift "$(($1 + 1))"
	printf '%s\0' "$@" >>"$M"
}

cmd_start() {
	_m=$1
	shift
	[ $# -ge 1 ] || usage "missing execution id"
	valid_id "$1" || usage "invalid execution id: $1"
	S_id=$1
	shift
	parse_opts "$_m" "$@"
	marker "$S_id"
	# Secret variables: the first --secret-env bytes of stdin, NAME=VALUE lines.
	# They go to the supervisor in its environment (readable by this user
	# only), never on a command line and never into the marker.
	_senv=
	if [ -n "$O_SENV" ] && [ "$O_SENV" -gt 0 ]; then
		_senv=$(dd bs=1 count="$O_SENV" 2>/dev/null && echo .) || fail "$X_INTERNAL" "cannot read the secret environment"
		_senv=${_senv%.}
		_r=$_senv
		while [ -n "$_r" ]; do
			_l=${_r%%"$NL"*}
			case $_r in
			*"$NL"*) _r=${_r#*"$NL"} ;;
			*) _r= ;;
			esac
			case $_l in
			*=*) ;;
			*) usage "--secret-env: a line is not NAME=VALUE or @N=VALUE" ;;
			esac
			_k=${_l%%=*}
			case $_k in
			# @N: the Nth argv word, secret (its place after -- is empty).
			@*)
				case ${_k#@} in
				'' | 0* | *[!0123456789]*) usage "--secret-env: invalid argv position: $_k" ;;
				esac
				[ "${_k#@}" -le $(($# - O_NOPT)) ] || usage "--secret-env: no argv word at $_k"
				continue
				;;
			'' | [0123456789]* | *[!$NAME_CHARS]*) usage "invalid environment variable name: $_k" ;;
			esac
			O_ENVN="$O_ENVN $_k"
		done
	fi
	_in=
	if [ "$O_STDIN" = 1 ]; then
		# Taken before the marker exists, so a slow upload never holds a
		# marker in `starting`.
		ensure_exec_dir
		_in=$E/.stdin.$S_id.$$
		cat >"$_in" || fail "$X_INTERNAL" "cannot store stdin"
	fi
	clock
	if ! claim; then
		[ ! -e "$M" ] || refuse "$_in"
		ensure_exec_dir
		if ! claim; then
			[ ! -e "$M" ] || refuse "$_in"
			fail "$X_INTERNAL" "cannot create marker $M"
		fi
	fi
	[ "$O_HAS_CWD" = 0 ] || printf '%s' "$O_CWD" >"${F}cwd"
	# shellcheck disable=SC2086
	[ -z "$O_ENVN" ] || printf '%s\n' $O_ENVN >"${F}env_names"
	save_argv "$O_NOPT" "$@"
	[ -z "$_in" ] || mv -f "$_in" "${F}stdin" || fail "$X_INTERNAL" "cannot store stdin"
	if [ "$_m" = run ]; then
		# In the foreground: the wrapper waits for its own child, no polling.
		if [ -n "$SERVING" ]; then
			# The serve worker has a session of its own already, and this is
			# a subshell of it: it supervises itself, and outlives the SSH
			# session without setsid, a new sh or another fork.
			{ supervise run "$S_id" "$@"; } </dev/null >/dev/null 2>>"$M"
		else
			# setsid execs in place (a child is no group leader) and starts a
			# new session, so the supervisor outlives this SSH session.
			# shellcheck disable=SC2086
			WAYMARK_WRAP_SECRET_ENV=$_senv setsid $SH "$0" _sup run "$S_id" "$@" </dev/null >/dev/null 2>>"$M"
		fi
		load_status "$S_id"
		[ "$S_state" != starting ] || no_supervisor
		print_run "$O_INLINE"
		exit 0
	fi
	# Double setsid: the inner one is a process group leader, so it forks and
	# returns at once, its child starting a new session.  No `&`: an
	# asynchronous list would start the supervisor, and so the command, with
	# SIGINT and SIGQUIT ignored.  The pipe on fd 4 brings `p` once the command
	# is recorded, or end-of-file if the supervisor ended first.
	# shellcheck disable=SC2086
	if WAYMARK_WRAP_SECRET_ENV=$_senv setsid setsid $SH "$0" _sup start "$S_id" "$@" 4>&1 </dev/null >/dev/null 2>>"$M" |
		{
			while read -r _w; do
				[ "$_w" != p ] || exit 0
			done
			exit 1
		}; then
		:
	else
		load_status "$S_id"
		[ "$S_state" != starting ] || no_supervisor
	fi
	load_status "$S_id"
	print_status status
	printf '\n'
	exit 0
}

# no_supervisor: the supervisor of $M is gone without a record: fence the
# marker (never launched) and fail.
no_supervisor() {
	rec "${F}abandoned" "$NOW"
	fail "$X_INTERNAL" "the supervisor did not start (setsid and $SH needed); marker fenced"
}

cmd_wait() {
	[ $# -ge 1 ] || usage "missing execution id"
	valid_id "$1" || usage "invalid execution id: $1"
	_id=$1
	_max=$INLINE_DEFAULT
	shift
	while [ $# -gt 0 ]; do
		case $1 in
		--inline-max)
			[ $# -ge 2 ] || usage "--inline-max needs a value"
			uint "$2" --inline-max
			_max=$N
			shift 2
			;;
		*) usage "unknown option: $1" ;;
		esac
	done
	load_status "$_id"
	[ "$S_state" != absent ] || fail "$X_NOID" "unknown execution id: $_id"
	while [ "$S_state" = starting ]; do
		nap
		load_status "$_id"
	done
	if [ "$S_state" = running ]; then
		wait_sup
		load_status "$_id"
	fi
	print_run "$_max"
	exit 0
}

# status ID...: one status block per ID, in order (each ends with its empty
# line), so a client can check many executions in one round trip.
cmd_status() {
	[ $# -ge 1 ] || usage "usage: status ID..."
	for _sid in "$@"; do
		valid_id "$_sid" || usage "invalid execution id: $_sid"
	done
	_k=
	for _sid in "$@"; do
		load_status "$_sid"
		# A timekeeper that was killed is started again by the next look at
		# a timed execution, so its deadlines still fire.
		if [ -z "$_k" ] && [ "$S_state" = running ] && [ -n "$S_timeout" ]; then
			_k=1
			keeper_runs 2>/dev/null
		fi
		print_status status
		printf '\n'
	done
	exit 0
}

# output ID STREAM OFFSET MAX [BOUNDARY]: with BOUNDARY (16 to 64 characters of
# 0-9a-f, the caller's random pick) the header says `boundary=BOUNDARY` and
# the bytes end with a line `--BOUNDARY` after a newline: the reader finds
# their end by it, not by LEN, so a stream cut shorter (a command that writes
# to /dev/stdout reopens its file with O_TRUNC) between the size and the read
# gives fewer bytes, never a reply out of step on a serve channel.
cmd_output() {
	[ $# -eq 4 ] || [ $# -eq 5 ] || usage "usage: output ID stdout|stderr OFFSET MAX [BOUNDARY]"
	valid_id "$1" || usage "invalid execution id: $1"
	_bd=
	if [ $# -eq 5 ]; then
		valid_boundary "$5" || usage "invalid boundary: $5"
		_bd=$5
	fi
	# On a serve channel the bytes must never put the channel out of step.
	[ -z "$SERVING" ] || [ -n "$_bd" ] || usage "a served output needs a BOUNDARY"
	case $2 in
	stdout | stderr) ;;
	*) usage "stream must be stdout or stderr, got '$2'" ;;
	esac
	uint "$3" offset
	_off=$N
	uint "$4" max
	_max=$N
	marker "$1"
	[ -e "$M" ] || fail "$X_NOID" "unknown execution id: $1"
	# Look for the exit record first: when it is there, the size is final.
	_fin=0
	[ ! -e "${F}exit" ] || _fin=1
	fsize "$F$2"
	_len=$((FS - _off))
	[ "$_len" -ge 0 ] || _len=0
	[ "$_len" -le "$_max" ] || _len=$_max
	# The first chunk of a final stream that does not fit carries the SHA-256 of all of it
	# (exactly SIZE bytes: a process left behind may still append).
	_sha=
	if [ "$_fin" = 1 ] && [ "$_off" = 0 ] && [ "$_len" -lt "$FS" ]; then
		_sha=$(head -c "$FS" "$F$2" | sha256sum) || _sha=-
		_sha=${_sha%% *}
	fi
	printf '%s output\nid=%s\nstream=%s\nsize=%s\noffset=%s\nlength=%s\nfinished=%s\n' \
		"$P" "$1" "$2" "$FS" "$_off" "$_len" "$_fin"
	[ -z "$_sha" ] || printf 'sha256=%s\n' "$_sha"
	[ -z "$_bd" ] || printf 'boundary=%s\n' "$_bd"
	printf '\n'
	if [ "$_len" -gt 0 ]; then
		if [ "$_off" = 0 ]; then
			head -c "$_len" "$F$2"
		else
			tail -c "+$((_off + 1))" "$F$2" | head -c "$_len"
		fi
	fi
	[ -z "$_bd" ] || printf '\n--%s\n' "$_bd"
	exit 0
}

# watch MS ID STDOUT_SIZE STDERR_SIZE [ID STDOUT_SIZE STDERR_SIZE]...: waits up
# to MS milliseconds (at most 60000) for news of the listed executions: a
# stream whose size is not the one given, or an exit record.  Then one watch
# block per execution with news, or none when MS passed without any.  The
# first look sizes every stream; the next comes WATCH_TICK later, and each
# quiet one doubles the pause up to a second.  A look after the first sizes
# only the streams written since the look before last (`! REF -nt FILE`: a
# stream whose mtime is not older than the reference file truncated then), so
# a quiet execution costs a look a few stat calls and no program.  A stream
# written in the same clock tick (or, where `test` compares whole seconds, the
# same second) as the reference is sized again: never missed.  `-nt` is not
# POSIX; dash, bash and busybox have it, and a `test` without it fails, which
# sizes the stream at every look: slower, never wrong.
# shellcheck disable=SC3013
cmd_watch() {
	if [ $# -lt 4 ] || [ $((($# - 1) % 3)) != 0 ]; then
		usage "usage: watch MS ID STDOUT_SIZE STDERR_SIZE [ID STDOUT_SIZE STDERR_SIZE]..."
	fi
	uint "$1" ms
	[ "$N" -le 60000 ] || usage "watch waits at most 60000 ms, got $1"
	_wms=$N
	shift
	# One word list for every look, checked as it is built (nothing is written
	# before): ids and sizes hold no blank, and globbing is off.  A marker of
	# layout 1 keeps its streams in its directory: `/ID`.
	_wargs=
	while [ $# -gt 0 ]; do
		valid_id "$1" || usage "invalid execution id: $1"
		isnum "$2" || usage "a stream size must be a non-negative integer, got '$2'"
		isnum "$3" || usage "a stream size must be a non-negative integer, got '$3'"
		_wk=$1
		[ ! -d "$E/$1" ] || _wk=/$1
		_wargs="$_wargs $_wk $2 $3"
		shift 3
	done
	clock
	_wend=$((NOW + _wms))
	# Two reference files, truncated in turn: the one not truncated at this
	# look holds the time of the look before.
	_wr=$E/.watch.$$
	_wnow=$_wr.a
	_wold=$_wr.b
	_wall=1
	_wtick=$WATCH_TICK
	# Names relative to the exec dir: an id holds no blank, the remote dir may.
	cd "$E" || fail "$X_INTERNAL" "cannot enter $E"
	while :; do
		# `true`, not `:`: a failed redirection of a special builtin ends the shell.
		true >"$_wnow" || fail "$X_INTERNAL" "cannot write $_wnow"
		# First what to size: for each execution its exit flag (0 or 1), then
		# for each of its streams `-` (keep the caller's size), `0` (empty) or
		# `w` (to size); and the files to size, in one `wc -c`, not one each:
		# a look at a hundred streams that all grew runs one program.
		_wneed=
		_wfiles=
		# shellcheck disable=SC2086
		set -- $_wargs
		while [ $# -gt 0 ]; do
			case $1 in
			/*) F=${1#/}/ ;;
			*) F=$1. ;;
			esac
			# The exit record first: when it is there, the sizes taken after are final.
			_wx=0
			[ ! -e "${F}exit" ] || _wx=1
			_wneed="$_wneed $_wx"
			for _ws in stdout stderr; do
				if [ "$_wall$_wx" = 00 ] && [ "$_wold" -nt "$F$_ws" ] 2>/dev/null; then
					_wneed="$_wneed -"
				elif [ -s "$F$_ws" ]; then
					_wneed="$_wneed w"
					_wfiles="$_wfiles $F$_ws"
				else
					_wneed="$_wneed 0"
				fi
			done
			shift 3
		done
		# One line `SIZE NAME` per file, in order (and a total after two or
		# more).  A file gone meanwhile (collected) has no line: the sizes after
		# it are then off by one stream for this look, which can only make news
		# that is not (the reader finds nothing new) or miss some for one look.
		_wsz=
		# shellcheck disable=SC2086
		[ -z "$_wfiles" ] || _wsz=$(wc -c $_wfiles 2>/dev/null)$NL
		_wblocks=
		# shellcheck disable=SC2086
		set -- $_wargs
		while [ $# -gt 0 ]; do
			_wid=${1#/}
			_wo=$2
			_we=$3
			for _ws in x o e; do
				_wneed=${_wneed# }
				_wd=${_wneed%% *}
				_wneed=${_wneed#"$_wd"}
				case $_ws$_wd in
				x*) ;;
				?0) _wv=0 ;;
				?w)
					_wl=${_wsz%%"$NL"*}
					_wsz=${_wsz#*"$NL"}
					_wl=${_wl#"${_wl%%[!	 ]*}"}
					_wv=${_wl%%[!0123456789]*}
					isnum "$_wv" || continue
					;;
				*) continue ;;
				esac
				case $_ws in
				x) _wx=$_wd ;;
				o) _wo=$_wv ;;
				*) _we=$_wv ;;
				esac
			done
			if [ "$_wx" = 1 ] || [ "$_wo" != "$2" ] || [ "$_we" != "$3" ]; then
				_wblocks="$_wblocks$P watch${NL}id=$_wid${NL}stdout_bytes=$_wo${NL}stderr_bytes=$_we${NL}ended=$_wx${NL}${NL}"
			fi
			shift 3
		done
		_wall=0
		clock
		if [ -n "$_wblocks" ] || [ "$NOW" -ge "$_wend" ]; then
			[ -n "$SERVING" ] || rm -f "$_wnow" "$_wold"
			printf '%s' "$_wblocks"
			exit 0
		fi
		_wt=$_wnow
		_wnow=$_wold
		_wold=$_wt
		# The pause, or what is left of the wait when that is shorter.
		_wl=$((_wend - NOW))
		case $_wtick in
		0.25) _wp=250 ;;
		0.5) _wp=500 ;;
		*) _wp=1000 ;;
		esac
		if [ "$_wl" -lt "$_wp" ]; then
			sleep "0.$(printf '%03d' "$_wl")" 2>/dev/null || sleep 1
		else
			sleep "$_wtick" 2>/dev/null || sleep 1
		fi
		case $_wtick in
		0.25) _wtick=0.5 ;;
		*) _wtick=1 ;;
		esac
	done
}

cmd_cancel() {
	if [ $# -lt 1 ] || [ $# -gt 2 ]; then
		usage "usage: cancel ID [GRACE_SECS]"
	fi
	valid_id "$1" || usage "invalid execution id: $1"
	uint "${2:-$GRACE_DEFAULT}" grace
	_g=$N
	load_status "$1"
	case $S_state in
	absent) fail "$X_NOID" "unknown execution id: $1" ;;
	completed | timed_out | cancelled)
		print_status status
		printf '\n'
		exit 0
		;;
	esac
	[ -e "${F}cancel" ] || rec "${F}cancel" "$NOW $_g" || fail "$X_INTERNAL" "cannot record the cancel request"
	# The signalling runs detached, so a dropped session cannot stop it half way.
	# shellcheck disable=SC2086
	setsid setsid $SH "$0" _cancel "$1" </dev/null >/dev/null 2>>"${F}wrap.log" ||
		fail "$X_INTERNAL" "cannot launch the cancel worker (setsid)"
	_n=$(((_g + 5) * 10))
	while [ "$_n" -gt 0 ]; do
		load_status "$1"
		case $S_state in
		running) wait_sup ;;
		starting) nap ;;
		interrupted) [ "$S_alive" = yes ] || break ;;
		*) break ;;
		esac
		nap
		_n=$((_n - 1))
	done
	print_status status
	printf '\n'
	exit 0
}

cancel_worker() {
	marker "$1"
	_g=$GRACE_DEFAULT
	{ read -r _ _g <"${F}cancel"; } 2>/dev/null
	isnum "$_g" || _g=$GRACE_DEFAULT
	_n=0
	while [ "$_n" -lt 300 ]; do
		[ ! -e "${F}exit" ] || exit 0
		read_cmd
		if [ -n "$S_cmd" ]; then
			_pg=$S_cmd
			_pgs=$_cs
			# The group exists once the recorded process has called setsid;
			# until then the process is alive and the kill fails: retry.
			if pstart "$_pg"; then
				[ "$PS" = "$_pgs" ] || exit 0
				kill -TERM -"$_pg" 2>/dev/null && break
			else
				kill -TERM -"$_pg" 2>/dev/null && break
				exit 0
			fi
		else
			load_status "$1"
			case $S_state in
			starting | running) ;;
			*) exit 0 ;;
			esac
		fi
		_n=$((_n + 1))
		nap
	done
	drain_group "$_pg" "$_pgs" "$_g"
}

cmd_gc() {
	if [ $# -ne 2 ] || [ "$1" != --older-than ]; then
		usage "usage: gc --older-than SECS"
	fi
	uint "$2" --older-than
	_age=$((N * 1000))
	clock
	printf '%s gc\n' "$P"
	set +f
	# Leftovers of a gc that died after its rename.
	for _d in "$E"/.gc.*; do
		[ ! -e "$_d" ] || rm -rf "$_d"
	done
	# The stderr file of a serve worker that was killed (a live one removes its own).
	for _d in "$E"/.serve.*; do
		[ -e "$_d" ] || continue
		kill -0 "${_d##*.}" 2>/dev/null || rm -f "$_d"
	done
	# The reference files of a watch whose worker (or wrapper) was killed.
	for _d in "$E"/.watch.*; do
		[ -e "$_d" ] || continue
		_p=${_d%.*}
		kill -0 "${_p##*.}" 2>/dev/null || rm -f "$_d"
	done
	for _d in "$E"/act_*; do
		_id=${_d##*/}
		if ! valid_id "$_id"; then
			# A file of a marker whose claim is gone: left by a gc that died
			# half way (a live marker's claim exists before its files).
			[ -e "$E/${_id%%.*}" ] || rm -f "$_d"
			continue
		fi
		marker "$_id"
		read_exit || continue
		[ $((NOW - S_finished)) -ge "$_age" ] || continue
		# Move the claim first (one mv, in argument order): the id turns
		# absent at once, never half removed.
		_t=$E/.gc.$_id.$$
		if [ "$MF" = "$M" ]; then
			mkdir "$_t" 2>/dev/null && mv -f "$M" "$F"* "$_t"/ 2>/dev/null
			[ ! -e "$M" ] || continue
		else
			mv -f "$M" "$_t" 2>/dev/null || continue
		fi
		rm -rf "$_t"
		printf 'removed=%s\n' "$_id"
	done
	set -f
	printf '\n'
	exit 0
}

# ---------------------------------------------------------------- serve

# serve: many requests over one channel.  sshd made the shell it started a
# process group leader, where setsid would fork and return at once; a child of
# this shell leads no group, so there setsid starts the worker's own session in
# place.  The supervisors the worker forks are then out of reach of the SSH
# session's process group, as a `run`'s are.
cmd_serve() {
	[ $# -eq 0 ] || usage "usage: serve"
	# shellcheck disable=SC2086
	setsid $SH "$0" _serve || fail "$X_INTERNAL" "the serve worker did not start (setsid and $SH needed)"
	exit 0
}

# The worker: `waymark-serve/1 ready`, then one reply per request line:
# whatever the verb writes on stdout, then `waymark-serve/1 end EXIT LINES` and
# LINES lines of its stderr.  A request is `VERB` and words, each quoted as
# serve_words checks; a line cut short by end of input is never run.
serve_worker() {
	SERVING=1
	ensure_exec_dir
	_ef=$E/.serve.$$
	# shellcheck disable=SC2064 # $$ is this worker's pid now, and in its subshells
	trap "rm -f '$_ef' '$E/.watch.$$.a' '$E/.watch.$$.b'" EXIT
	printf '%s ready\n' "$SP"
	while IFS= read -r _q; do
		serve_one "$_q"
	done
	exit 0
}

# serve_words TEXT: TEXT is empty or words each led by one space, every word
# 'pieces' in single quotes joined by "$Q" (a quote) or "$NL" (a newline):
# what eval can only unquote.  (dash exits on a syntax error in eval: nothing
# unchecked reaches it.)  Split at every quote, the fields alternate between
# inside and outside the quotes; outside ones must be a space or a join.  The
# split is linear: a check that cut the line piece by piece would copy the rest
# of it at every step, quadratic in the line's length.
# shellcheck disable=SC2016
serve_words() {
	case $1 in
	'') return 0 ;;
	" '"*) ;;
	*) return 1 ;;
	esac
	IFS=\'
	# The `.` after the closing quote makes the last field, so an empty last
	# piece still counts.
	# shellcheck disable=SC2086
	set -- ${1#" '"}.
	IFS=' 	
'
	_n=$#
	_i=0
	for _f; do
		_i=$((_i + 1))
		case $((_i % 2)):$_f in
		1:*) ;;
		0:' ' | 0:'"$Q"' | 0:'"$NL"') [ "$_i" != "$_n" ] || return 1 ;;
		0:.) [ "$_i" = "$_n" ] || return 1 ;;
		*) return 1 ;;
		esac
	done
	[ $((_n % 2)) = 0 ]
}

serve_one() {
	case $1 in
	run | "run "*) _v=run ;;
	status | "status "*) _v=status ;;
	watch | "watch "*) _v=watch ;;
	output | "output "*) _v=output ;;
	*)
		printf 'waymark-wrap: serve: unknown request: %.40s\n' "$1" >"$_ef"
		serve_end "$X_USAGE"
		return
		;;
	esac
	_a=${1#"$_v"}
	if ! serve_words "$_a"; then
		printf 'waymark-wrap: serve: malformed request words\n' >"$_ef"
		serve_end "$X_USAGE"
		return
	fi
	eval "set -- $_a"
	(
		case $_v in
		run) cmd_start run "$@" ;;
		watch) cmd_watch "$@" ;;
		output) cmd_output "$@" ;;
		*) cmd_status "$@" ;;
		esac
	) </dev/null 2>"$_ef"
	serve_end $?
}

# serve_end EXIT: the trailer of one reply, with the verb's stderr.
serve_end() {
	_n=0
	_b=
	if [ -s "$_ef" ]; then
		while IFS= read -r _l || [ -n "$_l" ]; do
			_b=$_b$_l$NL
			_n=$((_n + 1))
		done <"$_ef"
		: >"$_ef"
	fi
	printf '%s end %s %s\n%s' "$SP" "$1" "$_n" "$_b"
}

# ---------------------------------------------------------------- main

[ $# -ge 1 ] || usage "usage: VERB ARGS... (start run wait status watch output cancel gc serve version)"
_verb=$1
shift
case $_verb in
start | run) cmd_start "$_verb" "$@" ;;
wait) cmd_wait "$@" ;;
status) cmd_status "$@" ;;
watch) cmd_watch "$@" ;;
output) cmd_output "$@" ;;
cancel) cmd_cancel "$@" ;;
gc) cmd_gc "$@" ;;
version)
	printf '%s version\nprotocol=1\n\n' "$P"
	exit 0
	;;
serve) cmd_serve "$@" ;;
_serve) serve_worker "$@" ;;
_cancel) cancel_worker "$@" ;;
_keep) keeper ;;
*) usage "unknown verb: $_verb" ;;
esac
