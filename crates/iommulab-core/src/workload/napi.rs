//! NAPI scheduling of one channel with the device's completion-event moderation (mlx5 CQ moderation). A
//! channel's RX and TX completion queues arm their interrupts separately: an armed CQ fires `usecs` after
//! its last interrupt (EQE period mode: the period restarts when an event is generated, so a completion
//! that comes later than that fires at once) or after its latest completion (CQE period mode: the period
//! restarts at every CQE), or as soon as `frames` are pending (commit 9908aa29 "net/mlx5e: CQE based
//! moderation"; mlx5_ifc.h cq_period_mode); whichever CQ fires first schedules the poll, which runs
//! until napi_complete_done() re-arms both. Each (re)scheduling supersedes the earlier poll event, so a poll
//! event is live only at its own time.

pub use super::dim::Moderation;
use super::dim::{Dim, RX_CQE_PROFILES, TX_EQE_PROFILES};
use crate::host::{Event, Host};
use crate::sim::{Ctx, Time};

/// mlx5 TX completion-event moderation: en_main.c mlx5e_build_nic_params() sets EQE period mode for TX;
/// en.h MLX5E_PARAMS_DEFAULT_TX_CQ_MODERATION_USEC (0x10) and _PKTS (0x20).
pub const MLX5_TX_CQ_MODERATION: Moderation = Moderation {
    usecs: 16,
    frames: 32,
    from_cqe: false,
};

/// The completion queues of a channel.
pub const RX_CQ: usize = 0;
pub const TX_CQ: usize = 1;

/// One CQ's interrupt arming.
#[derive(Debug, Default, Clone, Copy)]
struct Arm {
    armed: bool,
    pending: u32,
    /// When this CQ's interrupt fires.
    fire: Option<Time>,
}

#[derive(Debug)]
pub struct Napi {
    /// The RX CQ's moderation (TX uses MLX5_TX_CQ_MODERATION).
    rx_moderation: Moderation,
    /// A poll is pending, running or armed to be raised by the device.
    scheduled: bool,
    arms: [Arm; 2],
    /// The time of the one live poll event (older events for this channel are stale).
    at: Option<Time>,
    /// The poll waits for its CPU and will be delivered again.
    cpu_wait: bool,
    /// Per CQ: interrupts raised (cq->event_ctr), and the packets and bytes its queue counted, which DIM
    /// samples; DIM for each CQ when adaptive moderation is on.
    events: [u64; 2],
    /// Per CQ: when its last interrupt fired (EQE mode times its period from there).
    last_event: [Option<Time>; 2],
    packets: [u64; 2],
    bytes: [u64; 2],
    dim: Option<[Dim; 2]>,
}

impl Napi {
    pub fn new(rx_moderation: Moderation) -> Self {
        Napi {
            rx_moderation,
            scheduled: false,
            arms: [Arm::default(); 2],
            at: None,
            cpu_wait: false,
            events: [0; 2],
            last_event: [None; 2],
            packets: [0; 2],
            bytes: [0; 2],
            dim: None,
        }
    }

    /// Adaptive moderation on both CQs (mlx5's default: en_main.c mlx5e_build_nic_params sets
    /// rx_dim_enabled and tx_dim_enabled when the device supports it).
    pub fn with_dim(mut self) -> Self {
        self.dim = Some([
            Dim::new(RX_CQE_PROFILES, true),
            Dim::new(TX_EQE_PROFILES, false),
        ]);
        self
    }

    /// The moderation `cq` runs with now.
    fn moderation(&self, cq: usize) -> Moderation {
        match &self.dim {
            Some(d) => d[cq].moderation(),
            None if cq == RX_CQ => self.rx_moderation,
            None => MLX5_TX_CQ_MODERATION,
        }
    }

    /// The queue behind `cq` handled `packets` of `bytes` (its rq or sq stats, which DIM samples).
    pub fn count(&mut self, cq: usize, packets: u64, bytes: u64) {
        self.packets[cq] += packets;
        self.bytes[cq] += bytes;
    }

    /// Schedule the poll at `at`, superseding any earlier-scheduled one (napi_schedule, or a repoll after
    /// the budget was used up).
    pub fn schedule(&mut self, at: Time) {
        self.scheduled = true;
        self.at = Some(at);
    }

    /// A completion entry of `cq` becomes visible at `at`: arm the interrupts if NAPI is idle, count it on
    /// an armed CQ. Returns the poll's new time when the caller must deliver a poll event then.
    pub fn completion(&mut self, cq: usize, at: Time) -> Option<Time> {
        let m = self.moderation(cq);
        if !self.scheduled {
            self.scheduled = true;
            for arm in &mut self.arms {
                arm.armed = true;
            }
        }
        if self.at.is_some_and(|poll| poll <= at) {
            // Completions are announced ahead of time: the poll comes before this one is visible, and
            // re-arms for it.
            return None;
        }
        let arm = &mut self.arms[cq];
        if !arm.armed {
            return None;
        }
        arm.pending += 1;
        let fire = if arm.pending >= m.frames {
            arm.armed = false;
            at
        } else if m.from_cqe {
            at + m.usecs * 1000
        } else if arm.fire.is_none() {
            // EQE mode: the period runs from the last interrupt; one long past fires at once.
            let period_end = self.last_event[cq].map_or(0, |e| e + m.usecs * 1000);
            at.max(period_end)
        } else {
            return None; // EQE mode: the period is already running
        };
        arm.fire = Some(fire);
        if self.cpu_wait {
            // The poll is raised and waits for its CPU (NAPI_STATE_SCHED): napi_schedule() from this interrupt
            // is a no-op; begin() counts the interrupt when the poll runs.
            return None;
        }
        let first = self.arms.iter().filter_map(|a| a.fire).min()?;
        if self.at == Some(first) {
            return None;
        }
        self.schedule(first);
        Some(first)
    }

    /// A poll event at `now`: whether it is the live one (not superseded). The CQs whose interrupt fired
    /// are disarmed (mlx5e_completion_event counts it); one still counting down its period stays armed and
    /// fires later, scheduling NAPI again.
    pub fn begin(&mut self, now: Time) -> bool {
        if !(self.cpu_wait || self.at == Some(now)) {
            return false;
        }
        self.at = None;
        for (cq, arm) in self.arms.iter_mut().enumerate() {
            if let Some(f) = arm.fire.filter(|&f| f <= now) {
                self.events[cq] += 1;
                self.last_event[cq] = Some(f);
                *arm = Arm::default();
            }
        }
        true
    }

    /// A poll event at `now` for a queue on `cpu`: true when it is live and has the CPU. A superseded event
    /// is dropped; a live one that finds its CPU busy is redelivered (as `ev`) when the CPU frees.
    pub fn enter(&mut self, host: &mut Host, cpu: usize, now: Time, ev: Event) -> bool {
        // While the poll waits for its CPU, only its redelivery (the CPU handed to it) runs it: any other poll
        // event of this channel is one NAPI_STATE_SCHED made a no-op.
        if self.cpu_wait && !host.cpu_granted(cpu) {
            return false;
        }
        if !self.begin(now) {
            return false;
        }
        self.cpu_wait = !host.cpu_acquire(cpu, now, ev, Ctx::Softirq);
        !self.cpu_wait
    }

    /// The poll could not get its CPU (`true`) and will be delivered again when the CPU frees.
    pub fn set_cpu_wait(&mut self, waiting: bool) {
        self.cpu_wait = waiting;
    }

    /// napi_complete_done(): idle until the next completion arms the interrupts.
    pub fn complete(&mut self) {
        self.scheduled = false;
    }

    /// The end of a poll at `t`: poll again at once when `busy` (a budget was used up: net_rx_action), else
    /// napi_complete_done() and re-arm for the RX and TX completions already on their way. The poll time
    /// to deliver, if any.
    pub fn finish(
        &mut self,
        t: Time,
        busy: bool,
        rx: impl IntoIterator<Item = Time>,
        tx: impl IntoIterator<Item = Time>,
    ) -> Option<Time> {
        if busy {
            self.schedule(t);
            return Some(t);
        }
        // mlx5e_handle_tx_dim() / mlx5e_handle_rx_dim() before the CQs are re-armed.
        if let Some(dims) = self.dim.as_mut() {
            for (cq, d) in dims.iter_mut().enumerate() {
                d.sample(t, self.events[cq], self.packets[cq], self.bytes[cq]);
            }
        }
        self.complete();
        for at in rx {
            self.completion(RX_CQ, at.max(t));
        }
        for at in tx {
            self.completion(TX_CQ, at.max(t));
        }
        // An interrupt still armed from before fires on its own time (or at once: NAPI missed it).
        match self.arms.iter().filter_map(|a| a.fire).min() {
            Some(first) => {
                self.schedule(first.max(t));
                Some(first.max(t))
            }
            None => self.at.filter(|&p| p >= t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Moderation = Moderation {
        usecs: 3,
        frames: 4,
        from_cqe: true,
    };

    #[test]
    fn the_period_restarts_at_every_completion_and_frames_fire_at_once() {
        let mut n = Napi::new(M);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        assert_eq!(n.completion(RX_CQ, 200), Some(3200));
        assert!(!n.begin(3100), "superseded by the later completion");
        n.completion(RX_CQ, 300);
        assert_eq!(
            n.completion(RX_CQ, 400),
            Some(400),
            "the 4th pending fires at once"
        );
        assert_eq!(
            n.completion(RX_CQ, 500),
            None,
            "disarmed: the poll will see it"
        );
        assert!(n.begin(400));
        n.complete();
        assert_eq!(
            n.completion(RX_CQ, 600),
            Some(3600),
            "re-armed after napi_complete_done"
        );
    }

    #[test]
    fn a_completion_after_the_armed_interrupt_fires_does_not_delay_it() {
        let mut n = Napi::new(M);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        assert_eq!(
            n.completion(RX_CQ, 5000),
            None,
            "the interrupt at 3100 comes first"
        );
        assert!(n.begin(3100));
    }

    #[test]
    fn in_eqe_mode_the_period_runs_from_the_last_interrupt() {
        let eqe = Moderation {
            from_cqe: false,
            ..M
        };
        let mut n = Napi::new(eqe);
        // No interrupt yet: the first completion fires at once.
        assert_eq!(n.completion(RX_CQ, 100), Some(100));
        assert!(n.begin(100));
        assert_eq!(n.finish(200, false, [], []), None);
        // Within 3 µs of that interrupt a completion waits for the period's end; more do not move it.
        assert_eq!(n.completion(RX_CQ, 1000), Some(3100));
        assert_eq!(n.completion(RX_CQ, 2000), None);
        assert!(n.begin(3100));
        n.complete();
        // Later than a period after the last interrupt: at once, however few are pending.
        assert_eq!(n.completion(RX_CQ, 9000), Some(9000));
        assert!(n.begin(9000));
        n.complete();
        assert_eq!(n.completion(RX_CQ, 9500), Some(12_000));
        n.completion(RX_CQ, 9600);
        n.completion(RX_CQ, 9700);
        assert_eq!(
            n.completion(RX_CQ, 9800),
            Some(9800),
            "the 4th pending fires at once"
        );
    }

    /// A channel whose TX CQ interrupted at `at` and whose poll then completed.
    fn tx_interrupted_at(at: Time) -> Napi {
        let mut n = Napi::new(M);
        assert_eq!(n.completion(TX_CQ, at), Some(at));
        assert!(n.begin(at));
        n.complete();
        n
    }

    #[test]
    fn each_cq_arms_on_its_own_and_the_first_to_fire_schedules_the_poll() {
        let mut n = tx_interrupted_at(0);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        // A TX completion in EQE mode fires 16 µs after TX's last interrupt: later than RX, so the poll
        // stays at 3100.
        assert_eq!(n.completion(TX_CQ, 200), None);
        assert_eq!(n.completion(RX_CQ, 300), Some(3300), "RX's period restarts");
        assert!(n.begin(3300));
    }

    #[test]
    fn a_cq_still_counting_down_when_the_other_fires_fires_later_and_polls_again() {
        let mut n = tx_interrupted_at(100);
        // A TX completion at 1000 (EQE mode, 16 µs from the interrupt at 100) would fire at 16100; an RX
        // one at 200 fires at 3200 first.
        assert_eq!(n.completion(TX_CQ, 1000), Some(16_100));
        assert_eq!(n.completion(RX_CQ, 200), Some(3200));
        assert!(n.begin(3200));
        assert_eq!(n.events, [1, 1], "RX's interrupt counted");
        // The poll ends at 4000 with nothing on its way: TX's interrupt is still armed and comes at 16100.
        assert_eq!(n.finish(4000, false, [], []), Some(16_100));
        assert!(n.begin(16_100));
        assert_eq!(n.events, [1, 2]);
        assert_eq!(
            n.finish(17_000, false, [], []),
            None,
            "nothing armed is pending"
        );
    }

    #[test]
    fn with_dim_each_cq_starts_at_its_default_profile() {
        let n = Napi::new(M).with_dim();
        assert_eq!(
            (n.moderation(RX_CQ).usecs, n.moderation(RX_CQ).frames),
            (8, 128)
        );
        assert!(n.moderation(RX_CQ).from_cqe);
        assert_eq!(
            (n.moderation(TX_CQ).usecs, n.moderation(TX_CQ).frames),
            (8, 128)
        );
        assert!(!n.moderation(TX_CQ).from_cqe);
    }

    #[test]
    fn interrupts_while_the_poll_waits_for_its_cpu_add_no_poll() {
        // napi_schedule() on a NAPI already scheduled is a no-op (NAPI_STATE_SCHED): the waiting poll sees
        // the completions when it runs, and counts the interrupt that fired meanwhile.
        let mut n = Napi::new(M);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        assert!(n.begin(3100));
        n.set_cpu_wait(true);
        assert_eq!(n.completion(TX_CQ, 3200), None);
        assert_eq!(n.completion(RX_CQ, 3300), None);
        assert!(n.begin(9000), "the redelivery");
        assert_eq!(
            n.events,
            [1, 1],
            "TX's interrupt at 3200 counted when the poll ran"
        );
    }

    #[test]
    fn a_poll_waiting_for_its_cpu_stays_live() {
        let mut n = Napi::new(M);
        n.schedule(10);
        assert!(n.begin(10));
        n.set_cpu_wait(true);
        assert!(n.begin(50), "redelivered when the CPU frees");
    }
}
