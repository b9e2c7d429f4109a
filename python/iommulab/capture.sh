#!/bin/sh
# iommulab capture: record the kernel's iommu:map / iommu:unmap tracepoints (and iommu:io_page_fault and
# swiotlb:swiotlb_bounced where the kernel has them) through tracefs into a trace `iommulab replay` reads as it
# is. POSIX sh: runs on a minimal guest or a busybox initramfs, where Python is not installed (`iommulab capture
# --print-script` prints this file).
#
#   capture.sh -o TRACE [-d SECONDS] [-p PHASE] [-b KB] [-k] [-D] [-t] [-n] [-- COMMAND [ARG...]]
#
#   -o TRACE    output file; TRACE.xz is compressed with xz, TRACE.gz with gzip, anything else is plain text
#   -d SECONDS  record for this long (default: until COMMAND ends, or 10 s without one)
#   -p PHASE    bracket the recording with TB_BEGIN PHASE / TB_END PHASE markers (replay reports per phase)
#   -b KB       per-CPU ring buffer size while recording (default 65536)
#   -k          also record each map's and unmap's domain (kprobes on __iommu_map or iommu_map_nosync, and
#               __iommu_unmap), where the kernel allows kprobes; replay can then tell devices' domains apart.
#               Without kprobes, the DMA API's own events (as -D) where the kernel has them
#   -D          also record the DMA API's events (dma:dma_map_page or dma_map_phys, dma_map_sg, ..., Linux 6.12
#               and later), which name each mapping's device, and the IOMMU groups as comment lines
#   -t          also record when the flush queue's timer fires (a kprobe on fq_flush_timeout) and whose domain
#               it flushes (a kprobe on the IOMMU driver's flush_iotlb_all), where the kernel allows it; replay
#               then runs each domain's lazy flush timer as it ran
#   -L 'FUNC [ARGS]'  measure FUNC's latency: a kprobe at its entry (recording ARGS, kprobe_events fetch args
#               such as size=$arg4:u64) and a kretprobe at its return (iommulab/lat_FUNC, lat_FUNC_r); repeat -L
#               for more functions. A function not in kallsyms, or one the kernel refuses, is left out with a note.
#               With -L only these probes are recorded (not iommu:map/unmap, whose tracepoints would add their
#               own time to what is measured); `iommulab profile measure` reads the trace
#   -M          measure the DMA map/unmap path (as -L for each): iommu_dma_map_page, iommu_dma_unmap_page,
#               alloc_iova_fast, free_iova_fast, iommu_map (iommu_map_atomic before 6.3), iommu_unmap_fast,
#               iommu_iova_to_phys, queue_iova, intel_iommu_iotlb_sync_map, qi_submit_sync,
#               arm_smmu_cmdq_issue_cmdlist, viommu_sync_req, each with the argument that sizes its work
#   -n          dry run: print what would be done, change nothing
#
# It records into a tracing instance of its own (instances/iommulab: its own ring buffer, events and
# tracing_on), so the host's own tracing (its buffer, its events, its settings) is neither read nor changed. The
# only global changes are that instance and the kprobe events it adds, and both are removed on every exit: the
# end of the recording, an error, or SIGINT, SIGTERM or SIGHUP (the events read so far are kept). COMMAND runs
# with IOMMULAB_TRACE_MARKER set to the instance's trace_marker: write markers there (TB_BEGIN NAME / TB_END
# NAME split the trace into phases); the top-level trace_marker is not recorded. When recording stops, it waits
# (up to a minute) for its reader to drain the ring buffer. Events the ring buffer dropped (overruns) and events
# left unread are counted from per_cpu/*/stats and reported, and written as comment lines into the trace.
# A capture killed with SIGKILL cannot clean up: the next one names what was left and how to remove it.
#
# Where the kernel bounces DMA through swiotlb, each swiotlb_map() is recorded (swiotlb:swiotlb_bounced, fired
# before the pool is searched, so a mapping the full pool refused counts too), and where debugfs shows the pool
# (/sys/kernel/debug/swiotlb; debugfs is not mounted here) its state is read, and only read, into two comment
# lines: just before recording starts (before the events) and as it stops (after them):
#   # iommulab capture: swiotlb at start: nslabs=N used=N hiwater=N possible=CPULIST start=0xHEX transient=N
#   # iommulab capture: swiotlb at end: nslabs=N used=N hiwater=N possible=CPULIST start=0xHEX transient=N
# nslabs, used and hiwater are the 2 KiB slots of io_tlb_nslabs, io_tlb_used and io_tlb_used_hiwater (6.4+;
# since boot or since someone wrote 0 to it), possible is /sys/devices/system/cpu/possible (the pool's areas
# follow the possible CPUs), start the pool's physical start from the kernel log ("software IO TLB: mapped [mem
# START-END]", where dmesg shows it), transient io_tlb_transient_nslabs (CONFIG_SWIOTLB_DYNAMIC: a pool that
# grows). A key the kernel does not give is left out. IOMMULAB_DEBUGFS names another debugfs (tests).
set -u

out= dur= phase= bufkb=65536 kprobes=0 dmaev=0 timerprobe=0 dry=0 timer=0 latfns=
nl='
'
while [ $# -gt 0 ]; do
  case "$1" in
    # The argument positions are 6.1's and 6.12's (arm_smmu_cmdq_issue_cmdlist gained its cmdq argument in
    # 6.12: its 3rd to 5th are recorded, and read by the kernel version).
    -M) latfns="$latfns${latfns:+$nl}iommu_dma_map_page size=\$arg4:u64
iommu_dma_unmap_page size=\$arg3:u64
alloc_iova_fast pages=\$arg2:u64
free_iova_fast pages=\$arg3:u64
iommu_map size=\$arg4:u64
iommu_map_atomic size=\$arg4:u64
iommu_unmap_fast size=\$arg3:u64
iommu_iova_to_phys
queue_iova pages=\$arg3:u64
intel_iommu_iotlb_sync_map size=\$arg3:u64
qi_submit_sync count=\$arg3:u32
arm_smmu_cmdq_issue_cmdlist a3=\$arg3:s32 a4=\$arg4:s32 a5=\$arg5:u8
viommu_sync_req"; shift ;;
    -L) [ -n "${2-}" ] || { echo "capture: -L needs 'FUNC [ARGS]'" >&2; exit 2; }
        latfns="$latfns${latfns:+$nl}$2"; shift 2 ;;
    -o) out=${2-}; shift 2 ;;
    -d) dur=${2-}; shift 2 ;;
    -p) phase=${2-}; shift 2 ;;
    -b) bufkb=${2-}; shift 2 ;;
    -k) kprobes=1; shift ;;
    -D) dmaev=1; shift ;;
    -t) timerprobe=1; shift ;;
    -n) dry=1; shift ;;
    --) shift; break ;;
    *) echo "capture: unknown option $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
fail() { echo "capture: $*" >&2; exit 2; }
[ -n "$out" ] || fail "-o TRACE is required"
case "$bufkb" in ''|*[!0-9]*|0) fail "-b $bufkb: expected a size in KiB" ;; esac
case "$dur" in ''|*[!0-9.]*) [ -z "$dur" ] || fail "-d $dur: expected seconds" ;; esac
case "$phase" in *[!A-Za-z0-9_.-]*) fail "-p $phase: expected one word" ;; esac
if [ -n "$latfns" ]; then
  while IFS= read -r l; do
    case "${l%% *}" in ''|[0-9]*|*[!A-Za-z0-9_]*) fail "-L '$l': expected a kernel function name, then its fetch args" ;; esac
  done <<EOF
$latfns
EOF
fi

T=${IOMMULAB_TRACEFS-}  # another tracefs (tests)
KALLSYMS=${IOMMULAB_KALLSYMS-/proc/kallsyms}  # another kallsyms (tests)
[ -n "$T" ] || for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
  [ -e "$d/trace_marker" ] && { T=$d; break; }
done
[ -n "$T" ] && [ -e "$T/trace_marker" ] || fail "no tracefs (mount -t tracefs nodev /sys/kernel/tracing)"
if [ -n "$latfns" ]; then
  [ "$kprobes$dmaev$timerprobe" = 000 ] || fail "-L cannot be combined with -k, -D or -t (their events would add to what is measured)"
  [ -w "$T/kprobe_events" ] || [ "$dry" = 1 ] || fail "-L needs kprobes: $T/kprobe_events is not writable (CONFIG_KPROBE_EVENTS)"
else
  [ -d "$T/events/iommu/map" ] || fail "this kernel has no iommu:map tracepoint"
fi
[ "$dry" = 1 ] || [ -w "$T/trace_marker" ] || fail "needs root (writing $T)"
[ -d "$T/instances" ] || fail "$T has no instances/ (tracing instances, Linux 3.10+)"
case "$out" in
  *.xz) command -v xz >/dev/null 2>&1 || fail "-o $out: no xz here; use .gz or plain" ;;
  *.gz) command -v gzip >/dev/null 2>&1 || fail "-o $out: no gzip here; use plain" ;;
esac
# The output, checked before anything is changed: nothing is overwritten (a dangling link neither).
tmp=${out%.xz}
tmp=${tmp%.gz}.part
{ [ -e "$out" ] || [ -L "$out" ]; } && fail "-o $out: exists (nothing is overwritten)"
{ [ -e "$tmp" ] || [ -L "$tmp" ]; } && fail "-o $out: $tmp exists (an earlier capture's?); move it away first"
case "$out" in */*) outdir=${out%/*} ;; *) outdir=. ;; esac
[ -d "${outdir:-/}" ] || fail "-o $out: no such directory ${outdir:-/}"
[ -w "${outdir:-/}" ] || fail "-o $out: cannot write in ${outdir:-/}"
I=$T/instances/iommulab
[ -e "$I" ] && fail "$I exists: another capture is running, or one was killed (if none runs: rmdir '$I')"
[ -e "$T/events/iommulab" ] && fail "kprobe events iommulab/* are registered: another capture is running, or one was killed (if none runs, remove each: echo -:iommulab/NAME >> '$T/kprobe_events')"

events="iommu/map iommu/unmap"
[ -d "$T/events/iommu/io_page_fault" ] && events="$events iommu/io_page_fault"
# Each swiotlb_map() (a bounce, or an attempt the full pool refused), where the kernel has swiotlb.
[ -d "$T/events/swiotlb/swiotlb_bounced" ] && events="$events swiotlb/swiotlb_bounced"
[ -n "$latfns" ] && events=
# The DMA API's calls that map or unmap (kernel/dma/mapping.c), each naming its device.
dma_events=
# (dma_map_phys and dma_unmap_phys replace dma_map_page/dma_unmap_page and the resource pair in newer kernels.)
for e in dma_map_page dma_unmap_page dma_map_phys dma_unmap_phys dma_map_resource dma_unmap_resource dma_map_sg \
         dma_unmap_sg dma_alloc dma_free dma_alloc_pages dma_free_pages dma_alloc_sgt dma_free_sgt; do
  [ -d "$T/events/dma/$e" ] && dma_events="$dma_events dma/$e"
done
# kallsyms is read once for every function looked up below (the -L ones among them): a regular expression tried
# on each of its lines takes seconds on a slow or emulated CPU (5-10 s for a TCG guest's 150,000 symbols, where
# one fixed-string pass takes 1-2 s), and a capture looks up to a dozen functions. A name left out of the list is
# still found, by a read of its own.
ksym_names=" __iommu_map iommu_map_nosync dma_iova_unlink fq_flush_timeout"
ksym_names="$ksym_names intel_flush_iotlb_all arm_smmu_flush_iotlb_all amd_iommu_flush_iotlb_all viommu_flush_iotlb_all"
while IFS= read -r l; do [ -z "$l" ] || ksym_names="$ksym_names ${l%% *}"; done <<EOF
$latfns
EOF
ksym_names="$ksym_names "
ksym_lines=$(grep -F -e "$(for f in $ksym_names; do echo " $f"; done)" "$KALLSYMS" 2>/dev/null)
ksym() {  # a kernel function in kallsyms, built in or in a loaded module ("NAME\t[module]")
  case "$ksym_names" in
    *" $1 "*) printf '%s\n' "$ksym_lines" | grep -qE " $1([[:space:]]|\$)" ;;
    *) grep -qE " $1([[:space:]]|\$)" "$KALLSYMS" 2>/dev/null ;;
  esac
}
# The function every IOMMU map goes through, with the domain, IOVA and size as its 1st, 2nd and 4th arguments:
# __iommu_map(), renamed iommu_map_nosync() in newer kernels.
mapfn=
for f in __iommu_map iommu_map_nosync; do
  ksym "$f" && { mapfn=$f; break; }
done
if [ "$kprobes" = 1 ] && { [ ! -w "$T/kprobe_events" ] || [ -z "$mapfn" ]; }; then
  kprobes=0
  if [ -n "$dma_events" ]; then
    dmaev=1
    echo "capture: no kprobes here (kprobe_events not writable or neither __iommu_map nor iommu_map_nosync in kallsyms): the DMA API's events name each mapping's device instead" >&2
  else
    echo "capture: no kprobes here (kprobe_events not writable or neither __iommu_map nor iommu_map_nosync in kallsyms) and no DMA API events (Linux 6.12+): the trace will not name domains" >&2
  fi
fi
if [ "$dmaev" = 1 ]; then
  [ -n "$dma_events" ] || echo "capture: this kernel has no DMA API events (dma:dma_map_page, Linux 6.12+): the trace will not name devices" >&2
  events="$events$dma_events"
fi

# The swiotlb pool's state (header): read only, from debugfs where it is mounted and shows the pool.
SWIOTLB=${IOMMULAB_DEBUGFS-/sys/kernel/debug}/swiotlb
swiotlb_start=
if [ -r "$SWIOTLB/io_tlb_nslabs" ]; then
  # The pool's physical start, as the kernel logged it (a log dmesg cannot read leaves it out).
  swiotlb_start=$( (dmesg) 2>/dev/null | sed -n 's/.*software IO TLB: mapped \[mem \(0x[0-9a-fA-F]*\)-.*/\1/p' \
                   | tail -n 1 | sed 's/^0x0*\([0-9a-fA-F]\)/0x\1/')
fi
swiotlb_note() {  # start|end: one comment line, or nothing where debugfs does not show the pool
  [ -r "$SWIOTLB/io_tlb_nslabs" ] || return 0
  note="# iommulab capture: swiotlb at $1:"
  for kf in nslabs=io_tlb_nslabs used=io_tlb_used hiwater=io_tlb_used_hiwater possible= start= \
            transient=io_tlb_transient_nslabs; do
    case "$kf" in
      possible=) v=$(cat /sys/devices/system/cpu/possible 2>/dev/null) ;;
      start=) v=$swiotlb_start ;;
      *) v=$(cat "$SWIOTLB/${kf#*=}" 2>/dev/null); case "$v" in *[!0-9]*) v= ;; esac ;;
    esac
    [ -n "$v" ] && note="$note ${kf%%=*}=$v"
  done
  echo "$note"
}

# Every change to tracefs goes through put (write) or add (append): with -n they only print what they would do.
# A write tracefs refuses (EINVAL, EBUSY) fails the call; its message is the caller's to give.
put() {  # VALUE FILE
  if [ "$dry" = 1 ]; then echo "would: echo $1 > $2"; return 0; fi
  ( printf '%s\n' "$1" > "$2" ) 2>/dev/null
}
add() {  # LINE FILE
  if [ "$dry" = 1 ]; then echo "would: echo '$1' >> $2"; return 0; fi
  ( printf '%s\n' "$1" >> "$2" ) 2>/dev/null
}
nap() {  # SECONDS: a sleep that SIGINT, SIGTERM and SIGHUP cut short
  sleep "$1" & sleeper=$!
  [ "$stopped" = 1 ] || wait "$sleeper" 2>/dev/null
  kill "$sleeper" 2>/dev/null
  sleeper=
}

made=0 added_kprobes= reader= child= sleeper= stopped=0 cleaned=0 recording=0
stop_reader() {  # it holds the instance's trace_pipe open, and an instance in use cannot be removed
  [ -n "$reader" ] || return 0
  kill "$reader" 2>/dev/null
  while kill -0 "$reader" 2>/dev/null; do wait "$reader" 2>/dev/null; done  # a signal may cut a wait short
  reader=
}
# Undo every change, once, on any exit: the reader stops, the instance goes (its events with it), then the kprobe
# events (a kprobe enabled in any instance cannot be removed).
cleanup() {
  [ "$cleaned" = 1 ] && return 0
  cleaned=1
  for p in $child $sleeper; do kill "$p" 2>/dev/null; done
  stop_reader
  if [ "$made" = 1 ]; then
    for k in $added_kprobes; do put 0 "$I/events/iommulab/$k/enable"; done
    if [ "$dry" = 1 ]; then echo "would: rmdir $I"
    else rmdir "$I" 2>/dev/null || echo "capture: could not remove $I: remove it with: rmdir '$I'" >&2; fi
  fi
  for k in $added_kprobes; do
    add "-:iommulab/$k" "$T/kprobe_events" \
      || echo "capture: could not remove kprobe iommulab/$k: echo -:iommulab/$k >> '$T/kprobe_events'" >&2
  done
  [ "$recording" = 1 ] || [ "$dry" = 1 ] || rm -f "$tmp"
}
trap cleanup EXIT
# A signal's trap runs once the command in hand ends: one that lands just before a wait is seen by the
# check before it, one that lands during it ends the wait; either way what runs is killed.
trap 'stopped=1; for p in $child $sleeper; do kill "$p" 2>/dev/null; done' INT TERM HUP
interrupted() {  # before recording started: nothing is kept
  [ "$stopped" = 1 ] || return 0
  echo "capture: interrupted before recording; every change undone" >&2
  exit 130
}

# kprobe NAME FUNCTION 'ARGS' [TYPE]: a kprobe event on FUNCTION (TYPE r64: a kretprobe on its return, up to 64
# calls in flight at once), enabled in the instance. One that cannot be registered or enabled is left out (and
# removed) with a note; the capture goes on without it.
kprobe() {
  if ! add "${4:-p}:iommulab/$1 $2${3:+ $3}" "$T/kprobe_events"; then
    echo "capture: kprobe iommulab/$1 on $2 refused by the kernel: recording without it" >&2
    return 1
  fi
  added_kprobes="$added_kprobes $1"
  put 1 "$I/events/iommulab/$1/enable" && return 0
  echo "capture: kprobe iommulab/$1 on $2 registered but could not be enabled: removed, recording without it" >&2
  add "-:iommulab/$1" "$T/kprobe_events" && added_kprobes=${added_kprobes% $1}
  return 1
}

# The output file first: a capture that cannot write its trace changes nothing.
if [ "$dry" = 1 ]; then
  echo "tracefs: $T"
  echo "would: mkdir $I"
  made=1
else
  ( : > "$tmp" ) 2>/dev/null || fail "-o $out: cannot write $tmp"
  mkdir "$I" 2>/dev/null || { rm -f "$tmp"; fail "cannot make a tracing instance ($I)"; }
  made=1
fi
put 0 "$I/tracing_on" || fail "cannot turn tracing off in $I"
put "$bufkb" "$I/buffer_size_kb" || fail "-b $bufkb: the kernel refused this buffer size"
for e in $events; do put 1 "$I/events/$e/enable" || fail "cannot enable $e"; done
interrupted
if [ "$kprobes" = 1 ]; then
  # The domain pointer, IOVA and size of every __iommu_map (or iommu_map_nosync) and __iommu_unmap.
  kprobe tb_map "$mapfn" 'dom=$arg1:x64 iova=$arg2:x64 size=$arg4:u64'
  kprobe tb_unmap __iommu_unmap 'dom=$arg1:x64 iova=$arg2:x64 size=$arg3:u64'
  # The DMA API's IOVA interface (6.17+: nvme-pci's data): dma_iova_unlink() syncs the IOTLB at once, in a lazy
  # domain too; replay takes the unmap that follows on the CPU as such.
  ksym dma_iova_unlink && kprobe tb_iova_unlink dma_iova_unlink ''
fi
flushers=
if [ "$timerprobe" = 1 ]; then
  # dma-iommu.c's flush-queue timer callback (lazy mode): when the timer really fired.
  # Its domain: the cookie's fq_domain, past the timer (fq_timer, fq_timer_on) in struct iommu_dma_cookie: 64
  # bytes on Linux 6.1-6.14 without lockdep (msi_page_list lies between; read right on 6.1 and 6.12), 48 from 6.15 on (commit 6aa63a4ec947,
  # "iommu: Sort out domain user data", moved it out of the union).
  fqoff=64
  kv=$(uname -r 2>/dev/null); kmaj=${kv%%.*}; kmin=${kv#*.}; kmin=${kmin%%[!0-9]*}
  case "$kmaj$kmin" in *[!0-9]*|'') ;; *) { [ "$kmaj" -gt 6 ] || { [ "$kmaj" -eq 6 ] && [ "${kmin:-0}" -ge 15 ]; }; } && fqoff=48 ;; esac
  if [ -w "$T/kprobe_events" ] && ksym fq_flush_timeout \
     && kprobe fq_flush_timeout fq_flush_timeout "fq_domain=+$fqoff(\$arg1):x64"; then
    timer=1
    # Replay checks the fq_domain read against the domains the trace names. And the flush it makes, where the
    # driver's flush_iotlb_all(domain) can be probed: fq_flush_iotlb() calls it on the same CPU. Every
    # driver built in is probed (an x86 kernel has VT-d's and AMD's even where virtio-iommu serves the
    # devices); only the one in use fires. (arm64 kernels build arm-smmu and arm-smmu-v3 in, each with a static
    # arm_smmu_flush_iotlb_all: the kernel refuses a probe on a name two functions share, and $arg1 on a probe
    # by address; the fq_domain read names the domain there.)
    for f in intel_flush_iotlb_all arm_smmu_flush_iotlb_all amd_iommu_flush_iotlb_all viommu_flush_iotlb_all; do
      ksym "$f" || continue
      k=tb_flush_all_${f%_flush_iotlb_all}
      kprobe "$k" "$f" 'dom=$arg1:x64' && flushers="$flushers $k" && timer=2
    done
  else
    echo "capture: no kprobe on fq_flush_timeout here: the trace will not record the flush queue's timer" >&2
  fi
fi
latprobed=
if [ -n "$latfns" ]; then
  # Each -L function: its entry with the args asked for, and its return (its latency is the time between).
  while IFS= read -r l; do
    f=${l%% *}; fa=${l#"$f"}; fa=${fa# }
    ksym "$f" || { echo "capture: latency of $f: not in kallsyms (not in this kernel, or inlined): measuring without it" >&2; continue; }
    kprobe "lat_$f" "$f" "$fa" || continue
    if kprobe "lat_${f}_r" "$f" '' r64; then latprobed="$latprobed$nl$l"
    else echo "capture: latency of $f: no return probe: measuring without it" >&2; put 0 "$I/events/iommulab/lat_$f/enable"; fi
  done <<EOF
$latfns
EOF
  [ -n "$latprobed" ] || [ "$dry" = 1 ] || fail "-L: none of the functions could be probed"
fi
interrupted

if [ "$dry" = 1 ]; then
  echo "would record to $out${phase:+ with markers TB_BEGIN/TB_END $phase}${dur:+ for $dur s}${1:+ while running: $*}"
  exit 0
fi

# What the trace records, in its first lines (replay reads them).
{
  [ "$timer" != 0 ] && echo "# iommulab capture: flush queue timer recorded (kprobe fq_flush_timeout)"
  [ "$timer" = 2 ] && echo "# iommulab capture: flush queue timer's domain recorded (kprobes$flushers)"
  # With -L: where the latencies were measured, and what (`iommulab profile measure` reads these lines).
  if [ -n "$latprobed" ]; then
    echo "# iommulab measure: host $(uname -n 2>/dev/null)"
    echo "# iommulab measure: kernel $(uname -r 2>/dev/null)"
    echo "# iommulab measure: machine $(uname -m 2>/dev/null)"
    echo "# iommulab measure: date $(date -u +%Y-%m-%dT%H:%M:%SZ 2>/dev/null)"
    echo "# iommulab measure: cmdline $(cat /proc/cmdline 2>/dev/null)"
    for i in /sys/class/iommu/*; do [ -e "$i" ] && echo "# iommulab measure: iommu ${i##*/}"; done
    for g in /sys/kernel/iommu_groups/*; do
      [ -d "$g/devices" ] && echo "# iommulab measure: group ${g##*/} type $(cat "$g/type" 2>/dev/null) devices $(ls "$g/devices" | tr '\n' ' ')"
    done
    printf '%s\n' "$latprobed" | while IFS= read -r l; do [ -n "$l" ] && echo "# iommulab measure: probe $l"; done
  fi
  # With the DMA API's events, which devices share a domain: their IOMMU group.
  if [ "$dmaev" = 1 ] && [ -n "$dma_events" ]; then
    for g in /sys/kernel/iommu_groups/*; do
      [ -d "$g/devices" ] && echo "# iommulab capture: iommu group ${g##*/}: $(ls "$g/devices" | tr '\n' ' ')"
    done
  fi
  # The swiotlb pool as recording starts (its end state follows the events).
  swiotlb_note start
} >> "$tmp"
# The reader starts before tracing does, so that no event is missed; the trace is kept (on any exit) once
# tracing is on: until then it holds nothing recorded.
cat "$I/trace_pipe" >> "$tmp" &
reader=$!
put 1 "$I/tracing_on" || fail "cannot turn tracing on in $I"
recording=1
[ -n "$phase" ] && add "TB_BEGIN $phase" "$I/trace_marker"
status=0
if [ $# -gt 0 ]; then
  IOMMULAB_TRACE_MARKER=$I/trace_marker IOMMULAB_TRACE_INSTANCE=$I "$@" & child=$!
  # (A wait's 2>/dev/null silences the shell's own "Hangup" or "Terminated" for a job a signal ended.)
  [ "$stopped" = 1 ] || { wait "$child" 2>/dev/null; status=$?; }
  if [ "$stopped" = 1 ]; then
    # A TERM that reaches the command between its fork and its exec can be lost (the forked shell still has
    # this script's trap): send it again once the command runs, so the wait below cannot outlast it.
    kill "$child" 2>/dev/null; sleep 0.05 2>/dev/null; kill "$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  child=
else
  nap "${dur:-10}"
fi
[ -n "$phase" ] && add "TB_END $phase" "$I/trace_marker"
put 0 "$I/tracing_on"
swiotlb_end=$(swiotlb_note end)  # as recording stopped; written after the events
# A per-CPU stats field summed over CPUs: overrun (events overwritten before they were read), entries (events
# still in the ring buffer, not yet read).
stat_sum() {
  stat_total=0
  for s in "$I"/per_cpu/cpu*/stats; do
    n=$(sed -n "s/^$1: *//p" "$s" 2>/dev/null)
    case "$n" in ''|*[!0-9]*) n=0 ;; esac
    stat_total=$((stat_total + n))
  done
  echo "$stat_total"
}
# The reader lags behind a busy recording (a slow guest formats events slowly): let it drain the ring buffer
# before stopping it, up to a minute, then a second more to write out its last read.
left=60
while [ "$(stat_sum entries)" -gt 0 ] && [ "$left" -gt 0 ] && [ "$stopped" = 0 ] && kill -0 "$reader" 2>/dev/null; do
  nap 1; left=$((left - 1))
done
[ "$stopped" = 1 ] || nap 1
stop_reader
lost=$(stat_sum overrun)
unread=$(stat_sum entries)
# A kretprobe misses returns when more calls are in flight than it has instances for (kprobe_profile: name, hits,
# misses); a missed one leaves its entry unpaired.
[ -n "$latprobed" ] && while read -r name hits miss; do
  case "$name" in lat_*) [ "${miss:-0}" != 0 ] && echo "# iommulab measure: missed $name $miss" >> "$tmp" ;; esac
done 2>/dev/null < "$T/kprobe_profile"
[ -n "$swiotlb_end" ] && printf '%s\n' "$swiotlb_end" >> "$tmp"
[ "$lost" -gt 0 ] && echo "# iommulab capture: $lost events lost to ring-buffer overruns (raise -b)" >> "$tmp"
[ "$unread" -gt 0 ] && echo "# iommulab capture: $unread events lost: recorded, not read before the reader stopped" >> "$tmp"
cleanup
case "$out" in
  *.xz) xz -c "$tmp" > "$out" ;;
  *.gz) gzip -c "$tmp" > "$out" ;;
  *) mv "$tmp" "$out" ;;
esac && rm -f "$tmp" || { rm -f "$out"; echo "capture: could not write $out; the trace is in $tmp" >&2; exit 2; }
lostmsg=
[ "$lost" -gt 0 ] && lostmsg="; $lost events were lost to ring-buffer overruns (raise -b)"
[ "$unread" -gt 0 ] && lostmsg="$lostmsg; $unread events were recorded but not read before the reader stopped"
echo "capture: wrote $out${lostmsg:-; no events lost}" >&2
if [ "$stopped" = 1 ]; then
  echo "capture: interrupted; the events read so far are kept" >&2
  exit 130
fi
exit "$status"
