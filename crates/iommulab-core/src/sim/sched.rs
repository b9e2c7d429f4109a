//! Which waiting work gets a CPU next: softirq work (NAPI polls, timers, block completions) or task work
//! (socket readers, senders, fio threads).
//!
//! Work units run to completion; the choice is made whenever a CPU frees with work waiting:
//! - Softirq work runs ahead of tasks, as `irq_exit()` runs it before returning to the interrupted task.
//! - Once softirq work has run `MAX_SOFTIRQ_TIME` back to back with a task waiting, the rest goes to
//!   ksoftirqd (`__do_softirq()` gives up and calls `wakeup_softirqd()`); while ksoftirqd is runnable,
//!   new softirq work waits for it too (6.0 `invoke_softirq()`: `ksoftirqd_running()`).
//! - ksoftirqd and the task side are two CFS entities (kernel/sched/fair.c): each accrues vruntime as it
//!   runs; one that wakes is placed no further back than `min_vruntime` minus half the latency
//!   (`place_entity()`, GENTLE_FAIR_SLEEPERS) and preempts the running one if it is more than the wakeup
//!   granularity behind (`check_preempt_wakeup()`); otherwise the running one keeps the CPU until it has
//!   run its slice (`check_preempt_tick()`), or runs out of work. Preemption happens between work units.
//! - When ksoftirqd runs out of work it sleeps, and softirq work regains its priority.
//!
//! Whether a saturated receiver's sockets fill follows from this: a reader that needs less CPU than NAPI
//! sleeps, keeps its credit and preempts ksoftirqd as soon as data wakes it; one that needs more stays
//! runnable and shares the CPU in slices, while NAPI's backlog of pages waits in its socket.

use super::Time;
use std::collections::VecDeque;

/// kernel/softirq.c MAX_SOFTIRQ_TIME: `__do_softirq()` restarts for at most 2 ms before deferring to
/// ksoftirqd.
pub const MAX_SOFTIRQ_TIME_NS: Time = 2_000_000;

/// CFS tunables (kernel/sched/fair.c, 6.0), scaled by `factor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cfs {
    /// sysctl_sched_wakeup_granularity (1 ms unscaled).
    pub wakeup_granularity: Time,
    /// sysctl_sched_latency (6 ms unscaled): the period two runnable entities split.
    pub latency: Time,
    /// sysctl_sched_min_granularity (0.75 ms unscaled).
    pub min_granularity: Time,
}

impl Cfs {
    /// The defaults on a machine of `cores` CPUs: get_update_sysctl_factor() under
    /// SCHED_TUNABLESCALING_LOG is 1 + ilog2(min(cores, 8)), so 4 on a server.
    pub fn for_cores(cores: u32) -> Self {
        let factor = 1 + cores.clamp(1, 8).ilog2() as Time;
        Cfs {
            wakeup_granularity: 1_000_000 * factor,
            latency: 6_000_000 * factor,
            min_granularity: 750_000 * factor,
        }
    }

    /// sched_slice() of one of two equally weighted runnable entities.
    fn slice(&self) -> Time {
        self.latency / 2
    }
}

/// The context work runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ctx {
    Softirq = 0,
    Task = 1,
}

impl Ctx {
    fn other(self) -> Ctx {
        match self {
            Ctx::Softirq => Ctx::Task,
            Ctx::Task => Ctx::Softirq,
        }
    }
}

/// One CPU's waiting work and its softirq/ksoftirqd state.
#[derive(Debug, Clone)]
pub struct RunQueue<E> {
    waiting: [VecDeque<E>; 2],
    cfs: Cfs,
    /// Softirq work has been deferred to ksoftirqd.
    ksoftirqd: bool,
    /// vruntime of ksoftirqd and of the task side, and the queue's min_vruntime.
    vruntime: [Time; 2],
    min_vruntime: Time,
    /// The entity woke since the last choice (a wakeup-preemption check is due).
    woke: [bool; 2],
    /// The work last started: its context and start; when its context's current turn began.
    last: Option<(Ctx, Time)>,
    turn_start: Time,
    /// When the current back-to-back run of softirq work began.
    softirq_start: Time,
}

impl<E> RunQueue<E> {
    pub fn new(cfs: Cfs) -> Self {
        RunQueue {
            waiting: [VecDeque::new(), VecDeque::new()],
            cfs,
            ksoftirqd: false,
            vruntime: [0; 2],
            min_vruntime: 0,
            woke: [false; 2],
            last: None,
            turn_start: 0,
            softirq_start: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.iter().all(VecDeque::is_empty)
    }

    fn waits(&self, c: Ctx) -> bool {
        !self.waiting[c as usize].is_empty()
    }

    /// The last work ran until `prev_end`, and `c` continues it without a gap.
    fn continues(&self, c: Ctx, now: Time, prev_end: Time) -> bool {
        self.last.is_some_and(|(l, _)| l == c) && prev_end >= now
    }

    /// place_entity() of a waking entity: no more than half a latency of credit.
    fn wake(&mut self, c: Ctx) {
        let floor = self.min_vruntime.saturating_sub(self.cfs.latency / 2);
        let v = &mut self.vruntime[c as usize];
        *v = (*v).max(floor);
        self.woke[c as usize] = true;
    }

    /// Work of `ctx` waits for the CPU, busy until `prev_end`, at `now`.
    pub fn push(&mut self, ctx: Ctx, ev: E, now: Time, prev_end: Time) {
        let asleep = !self.waits(ctx) && !self.continues(ctx, now, prev_end);
        if ctx == Ctx::Task && asleep {
            self.wake(ctx);
        }
        self.waiting[ctx as usize].push_back(ev);
    }

    /// update_curr(): charge the work last started, which ran until `prev_end`, to its entity. Softirq
    /// work at irq exit is charged to nobody: with CONFIG_IRQ_TIME_ACCOUNTING (distribution kernels) the
    /// task clock excludes it.
    fn charge(&mut self, prev_end: Time) {
        let Some((l, start)) = self.last else {
            return;
        };
        if l == Ctx::Task || self.ksoftirqd {
            self.vruntime[l as usize] += prev_end.saturating_sub(start);
        }
        self.last = Some((l, start.max(prev_end)));
        let runnable = [Ctx::Softirq, Ctx::Task]
            .into_iter()
            .filter(|&c| self.waits(c) || c == l)
            .map(|c| self.vruntime[c as usize])
            .min();
        if let Some(v) = runnable {
            self.min_vruntime = self.min_vruntime.max(v);
        }
    }

    /// Work of `ctx` starts at `now` on a CPU that was busy until `prev_end`.
    pub fn started(&mut self, ctx: Ctx, now: Time, prev_end: Time) {
        self.charge(prev_end);
        if !self.continues(ctx, now, prev_end) {
            self.turn_start = now;
            if ctx == Ctx::Softirq {
                self.softirq_start = now;
            }
        }
        self.last = Some((ctx, now));
    }

    /// Between the running entity `cur` and a waiting `other`: does `other` get the CPU now?
    fn preempts(&self, cur: Ctx, other: Ctx, now: Time) -> bool {
        let lead = self.vruntime[cur as usize].saturating_sub(self.vruntime[other as usize]);
        let ran = now - self.turn_start;
        (self.woke[other as usize] && lead > self.cfs.wakeup_granularity)
            || ran >= self.cfs.slice()
            || (ran >= self.cfs.min_granularity && lead > self.cfs.slice())
    }

    /// The CPU is free at `now` (it was busy until `prev_end`): the next work to run, if any waits.
    pub fn pick(&mut self, now: Time, prev_end: Time) -> Option<E> {
        self.charge(prev_end);
        let (softirq, task) = (self.waits(Ctx::Softirq), self.waits(Ctx::Task));
        if !softirq {
            self.ksoftirqd = false; // ksoftirqd sleeps: nothing pending
        }
        let ctx = if !softirq && !task {
            return None;
        } else if self.ksoftirqd {
            let cur = self.last.map_or(Ctx::Task, |(c, _)| c);
            match (softirq, task) {
                (true, true) if self.preempts(cur, cur.other(), now) => cur.other(),
                (true, true) => cur,
                (true, false) => Ctx::Softirq,
                _ => Ctx::Task,
            }
        } else if softirq {
            let long = self.continues(Ctx::Softirq, now, prev_end)
                && now - self.softirq_start >= MAX_SOFTIRQ_TIME_NS;
            if task && long {
                // wakeup_softirqd(): the task resumes; ksoftirqd now competes with it.
                self.ksoftirqd = true;
                self.wake(Ctx::Softirq);
                Ctx::Task
            } else {
                Ctx::Softirq
            }
        } else {
            Ctx::Task
        };
        self.woke = [false; 2];
        let ev = self.waiting[ctx as usize].pop_front();
        self.started(ctx, now, prev_end);
        ev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> RunQueue<&'static str> {
        RunQueue::new(Cfs::for_cores(8))
    }

    #[test]
    fn tunables_scale_with_log_cpus_up_to_eight() {
        assert_eq!(Cfs::for_cores(1).wakeup_granularity, 1_000_000);
        assert_eq!(Cfs::for_cores(2).wakeup_granularity, 2_000_000);
        assert_eq!(Cfs::for_cores(8).latency, 24_000_000);
        assert_eq!(Cfs::for_cores(64), Cfs::for_cores(8));
    }

    #[test]
    fn softirq_goes_first_until_it_has_run_two_ms() {
        let mut rq = server();
        rq.started(Ctx::Softirq, 0, 0);
        rq.push(Ctx::Task, "read", 50, 100);
        rq.push(Ctx::Softirq, "poll", 100, 100);
        assert_eq!(rq.pick(100, 100), Some("poll"));
        rq.push(Ctx::Softirq, "poll", 200, 300);
        // Back to back for 2 ms with the reader waiting: ksoftirqd takes over and the reader runs.
        let t = MAX_SOFTIRQ_TIME_NS;
        assert_eq!(rq.pick(t, t), Some("read"));
        assert!(rq.ksoftirqd);
    }

    #[test]
    fn a_gap_restarts_the_softirq_run() {
        let mut rq = server();
        rq.started(Ctx::Softirq, 0, 0);
        rq.started(Ctx::Softirq, MAX_SOFTIRQ_TIME_NS + 5, 10); // idle in between
        let t = MAX_SOFTIRQ_TIME_NS + 100;
        rq.push(Ctx::Task, "read", t, t);
        rq.push(Ctx::Softirq, "poll", t, t);
        assert_eq!(rq.pick(t, t), Some("poll"));
    }

    /// ksoftirqd runs with the task waiting; returns who runs at each of `steps` unit boundaries 100 µs
    /// apart.
    fn contend(
        rq: &mut RunQueue<&'static str>,
        task_vruntime: Time,
        steps: u64,
    ) -> Vec<&'static str> {
        rq.ksoftirqd = true;
        rq.vruntime = [20_000_000, task_vruntime];
        rq.min_vruntime = 20_000_000;
        rq.started(Ctx::Softirq, 0, 0);
        let mut ran = vec![];
        for i in 1..=steps {
            let t = i * 100_000;
            // Both always have more work: each unit that ran queues its next one.
            if rq.waiting[0].is_empty() {
                rq.push(Ctx::Softirq, "poll", t, t);
            }
            if rq.waiting[1].is_empty() {
                rq.push(Ctx::Task, "read", t, t);
            }
            ran.push(rq.pick(t, t).unwrap());
        }
        ran
    }

    #[test]
    fn a_task_that_slept_long_preempts_ksoftirqd_at_once() {
        // Far behind: placed half a latency (12 ms) back, more than the 4 ms wakeup granularity.
        let ran = contend(&mut server(), 0, 1);
        assert_eq!(ran, ["read"]);
    }

    #[test]
    fn a_task_not_behind_waits_for_ksoftirqd_slice() {
        // Level: no wakeup preemption; ksoftirqd keeps the CPU until its slice (12 ms) is used.
        let ran = contend(&mut server(), 20_000_000, 130);
        let first_read = ran.iter().position(|&r| r == "read").unwrap();
        assert_eq!(first_read, 119, "switches at 12 ms: {ran:?}");
        // 1 ms behind: ksoftirqd's lead passes the slice first, after 11 ms.
        let ran = contend(&mut server(), 19_000_000, 130);
        assert_eq!(ran.iter().position(|&r| r == "read"), Some(110));
    }

    #[test]
    fn ksoftirqd_sleeps_when_it_runs_out_and_softirq_goes_first_again() {
        let mut rq = server();
        rq.ksoftirqd = true;
        rq.started(Ctx::Softirq, 0, 0);
        rq.push(Ctx::Task, "read", 10, 10);
        assert_eq!(rq.pick(10, 10), Some("read"));
        assert!(!rq.ksoftirqd);
        rq.push(Ctx::Task, "read", 20, 20);
        rq.push(Ctx::Softirq, "poll", 20, 20);
        assert_eq!(rq.pick(20, 20), Some("poll"));
    }
}
