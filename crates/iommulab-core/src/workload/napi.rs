//! NAPI scheduling of one channel with the device's completion-event moderation (mlx5 CQ moderation). A
//! channel's RX and TX completion queues arm their interrupts separately: an armed CQ fires `usecs` after
//! its first completion (EQE period mode) or after its latest one (CQE period mode: the period restarts at
//! every CQE), or as soon as `frames` are pending; whichever CQ fires first schedules the poll, which runs
//! until napi_complete_done() re-arms both. Each (re)scheduling supersedes the earlier poll event, so a poll
//! event is live only at its own time.

use crate::host::{Event, Host};
use crate::sim::{Ctx, Time};

/// A completion queue's event moderation.
#[derive(Debug, Clone, Copy)]
pub struct Moderation {
    pub usecs: u64,
    pub frames: u32,
    /// CQE period mode (the period restarts at every completion) rather than EQE mode.
    pub from_cqe: bool,
}

impl Moderation {
    /// CQE period mode: `usecs` after the latest completion or `frames` pending (mlx5 RX).
    pub fn cqe(usecs: u32, frames: u32) -> Self {
        Moderation {
            usecs: usecs as u64,
            frames,
            from_cqe: true,
        }
    }
}

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
}

impl Napi {
    pub fn new(rx_moderation: Moderation) -> Self {
        Napi {
            rx_moderation,
            scheduled: false,
            arms: [Arm::default(); 2],
            at: None,
            cpu_wait: false,
        }
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
        let m = if cq == RX_CQ {
            self.rx_moderation
        } else {
            MLX5_TX_CQ_MODERATION
        };
        if !self.scheduled {
            self.scheduled = true;
            self.arms = [Arm {
                armed: true,
                ..Arm::default()
            }; 2];
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
        } else if m.from_cqe || arm.fire.is_none() {
            at + m.usecs * 1000
        } else {
            return None; // EQE mode: the period runs from the first completion
        };
        arm.fire = Some(fire);
        let first = self.arms.iter().filter_map(|a| a.fire).min()?;
        if self.at == Some(first) {
            return None;
        }
        self.schedule(first);
        Some(first)
    }

    /// A poll event at `now`: whether it is the live one (not superseded). The interrupts are disarmed.
    pub fn begin(&mut self, now: Time) -> bool {
        if !(self.cpu_wait || self.at == Some(now)) {
            return false;
        }
        self.at = None;
        self.arms = [Arm::default(); 2];
        true
    }

    /// A poll event at `now` for a queue on `cpu`: true when it is live and has the CPU. A superseded event
    /// is dropped; a live one that finds its CPU busy is redelivered (as `ev`) when the CPU frees.
    pub fn enter(&mut self, host: &mut Host, cpu: usize, now: Time, ev: Event) -> bool {
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
        self.complete();
        let mut poll = None;
        for at in rx {
            poll = self.completion(RX_CQ, at.max(t)).or(poll);
        }
        for at in tx {
            poll = self.completion(TX_CQ, at.max(t)).or(poll);
        }
        poll.filter(|&p| self.at == Some(p))
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
    fn in_eqe_mode_the_period_runs_from_the_first_completion() {
        let eqe = Moderation {
            from_cqe: false,
            ..M
        };
        let mut n = Napi::new(eqe);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        assert_eq!(n.completion(RX_CQ, 200), None);
        assert_eq!(n.completion(RX_CQ, 300), None);
        assert_eq!(
            n.completion(RX_CQ, 400),
            Some(400),
            "the 4th pending fires at once"
        );
        assert!(n.begin(400));
    }

    #[test]
    fn each_cq_arms_on_its_own_and_the_first_to_fire_schedules_the_poll() {
        let mut n = Napi::new(M);
        assert_eq!(n.completion(RX_CQ, 100), Some(3100));
        // A TX completion in EQE mode fires 16 µs after it: later than RX, so the poll stays at 3100.
        assert_eq!(n.completion(TX_CQ, 200), None);
        assert_eq!(n.completion(RX_CQ, 300), Some(3300), "RX's period restarts");
        assert!(n.begin(3300));
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
