//! NAPI scheduling of one queue with the device's completion-event moderation (mlx5 CQ moderation in
//! CQE-period mode): an armed interrupt fires `usecs` after the latest completion (the period restarts at
//! every CQE) or as soon as `frames` are pending; the poll then runs until napi_complete_done() re-arms it.
//! Each (re)scheduling supersedes the earlier poll event, so a poll event is live only at its own time.

use crate::sim::Time;

/// A completion queue's event moderation.
#[derive(Debug, Clone, Copy)]
pub struct Moderation {
    pub usecs: u64,
    pub frames: u32,
}

/// en.h MLX5E_PARAMS_DEFAULT_TX_CQ_MODERATION_USEC (0x10) and _PKTS (0x20): TX completion-event moderation.
pub const MLX5_TX_CQ_MODERATION: Moderation = Moderation {
    usecs: 16,
    frames: 32,
};

#[derive(Debug, Default)]
pub struct Napi {
    /// A poll is pending, running or armed to be raised by the device.
    scheduled: bool,
    /// The interrupt is armed and counting completions.
    armed: bool,
    pending: u32,
    /// The time of the one live poll event (older events for this queue are stale).
    at: Option<Time>,
    /// The poll waits for its CPU and will be delivered again.
    cpu_wait: bool,
}

impl Napi {
    /// Schedule the poll at `at`, superseding any earlier-scheduled one (napi_schedule, or a repoll after
    /// the budget was used up).
    pub fn schedule(&mut self, at: Time) {
        self.scheduled = true;
        self.at = Some(at);
    }

    /// A completion entry becomes visible at `at`: arm the interrupt if NAPI is idle, move an armed one.
    /// Returns the poll's new time when the caller must deliver a poll event then.
    pub fn completion(&mut self, at: Time, m: Moderation) -> Option<Time> {
        if !self.scheduled {
            self.scheduled = true;
            self.armed = true;
            self.pending = 0;
        }
        if !self.armed {
            return None;
        }
        self.pending += 1;
        let fire = if self.pending >= m.frames {
            self.armed = false;
            at
        } else {
            at + m.usecs * 1000
        };
        self.schedule(fire);
        Some(fire)
    }

    /// A poll event at `now`: whether it is the live one (not superseded). The interrupt is disarmed.
    pub fn begin(&mut self, now: Time) -> bool {
        if !(self.cpu_wait || self.at == Some(now)) {
            return false;
        }
        self.at = None;
        self.armed = false;
        true
    }

    /// The poll could not get its CPU (`true`) and will be delivered again when the CPU frees.
    pub fn set_cpu_wait(&mut self, waiting: bool) {
        self.cpu_wait = waiting;
    }

    /// napi_complete_done(): idle until the next completion arms the interrupt.
    pub fn complete(&mut self) {
        self.scheduled = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Moderation = Moderation {
        usecs: 3,
        frames: 4,
    };

    #[test]
    fn the_period_restarts_at_every_completion_and_frames_fire_at_once() {
        let mut n = Napi::default();
        assert_eq!(n.completion(100, M), Some(3100));
        assert_eq!(n.completion(200, M), Some(3200));
        assert!(!n.begin(3100), "superseded by the later completion");
        n.completion(300, M);
        assert_eq!(
            n.completion(400, M),
            Some(400),
            "the 4th pending fires at once"
        );
        assert_eq!(n.completion(500, M), None, "disarmed: the poll will see it");
        assert!(n.begin(400));
        n.complete();
        assert_eq!(
            n.completion(600, M),
            Some(3600),
            "re-armed after napi_complete_done"
        );
    }

    #[test]
    fn a_poll_waiting_for_its_cpu_stays_live() {
        let mut n = Napi::default();
        n.schedule(10);
        assert!(n.begin(10));
        n.set_cpu_wait(true);
        assert!(n.begin(50), "redelivered when the CPU frees");
    }
}
