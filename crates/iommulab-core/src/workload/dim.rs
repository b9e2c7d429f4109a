//! Dynamic interrupt moderation: lib/dim/net_dim.c as mlx5 drives it (en_txrx.c mlx5e_handle_rx_dim /
//! mlx5e_handle_tx_dim at every napi_complete_done, en_dim.c applying the profile chosen).
//!
//! Every 64 interrupts of its completion queue (DIM_NEVENTS) DIM compares the bytes, packets and interrupts
//! per millisecond since the last decision with the ones before, and walks a table of five moderation
//! profiles: on while the stats compare better (more bytes, then more packets, then fewer interrupts, each by
//! more than 10 %), back when they do not, and it parks where a step each way did worse (net_dim_decision).

use crate::sim::Time;

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

/// Profiles per table (NET_DIM_PARAMS_NUM_PROFILES) and the one a queue starts at (NET_DIM_DEF_PROFILE_CQE
/// and _EQE).
const PROFILES: usize = 5;
const DEF_PROFILE: usize = 1;
/// Interrupts per measurement (include/linux/dim.h DIM_NEVENTS).
const NEVENTS: u64 = 64;

/// (usecs, packets) tables of lib/dim/net_dim.c: RX in CQE period mode (NET_DIM_RX_CQE_PROFILES), TX in EQE
/// mode (NET_DIM_TX_EQE_PROFILES, pkts = NET_DIM_DEFAULT_TX_CQ_PKTS_FROM_EQE); mlx5 moderates RX from the
/// CQE when the device can and TX always from the EQE (en_main.c mlx5e_build_nic_params).
pub const RX_CQE_PROFILES: [(u32, u32); PROFILES] =
    [(2, 256), (8, 128), (16, 64), (32, 64), (64, 64)];
pub const TX_EQE_PROFILES: [(u32, u32); PROFILES] =
    [(1, 128), (8, 128), (32, 128), (64, 128), (128, 128)];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tune {
    ParkingOnTop,
    ParkingTired,
    GoingRight,
    GoingLeft,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Worse,
    Same,
    Better,
}

/// Per-millisecond rates of one measurement (struct dim_stats).
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    ppms: u64,
    bpms: u64,
    epms: u64,
}

/// A sample of the queue's counters (struct dim_sample).
#[derive(Debug, Clone, Copy)]
struct Sample {
    time: Time,
    events: u64,
    packets: u64,
    bytes: u64,
}

/// IS_SIGNIFICANT_DIFF(): more than 10 % of the reference.
fn significant(val: u64, reference: u64) -> bool {
    reference != 0 && 100 * val.abs_diff(reference) / reference > 10
}

/// net_dim_stats_compare(): bytes, then packets, then events per ms decide, the first that moved by more
/// than 10 %. More bytes or packets is better, more events worse. From a zero reference, any bytes or
/// packets are better; events from zero are the same.
fn compare(curr: &Stats, prev: &Stats) -> Verdict {
    // (current, previous, more is better)
    for (c, p, more_is_better) in [
        (curr.bpms, prev.bpms, true),
        (curr.ppms, prev.ppms, true),
        (curr.epms, prev.epms, false),
    ] {
        if p == 0 {
            return if more_is_better && c != 0 {
                Verdict::Better
            } else {
                Verdict::Same
            };
        }
        if significant(c, p) {
            return if (c > p) == more_is_better {
                Verdict::Better
            } else {
                Verdict::Worse
            };
        }
    }
    Verdict::Same
}

/// One queue's DIM (struct dim), zero-initialised as mlx5e_dim_enable() allocates it.
#[derive(Debug, Clone)]
pub struct Dim {
    table: [(u32, u32); PROFILES],
    from_cqe: bool,
    profile: usize,
    tune: Tune,
    steps_left: u32,
    steps_right: u32,
    tired: u32,
    prev: Stats,
    start: Option<Sample>,
    /// The moderation the device applies (the default profile until DIM first moves).
    applied: usize,
}

impl Dim {
    pub fn new(table: [(u32, u32); PROFILES], from_cqe: bool) -> Self {
        Dim {
            table,
            from_cqe,
            profile: 0,
            tune: Tune::ParkingOnTop,
            steps_left: 0,
            steps_right: 0,
            tired: 0,
            prev: Stats::default(),
            start: None,
            applied: DEF_PROFILE,
        }
    }

    /// The moderation now in force.
    pub fn moderation(&self) -> Moderation {
        let (usecs, frames) = self.table[self.applied];
        Moderation {
            usecs: usecs as u64,
            frames,
            from_cqe: self.from_cqe,
        }
    }

    /// net_dim() with the queue's interrupts, packets and bytes so far, at `now`. True when the profile
    /// changed (the work item applies it and measuring starts over: mlx5e_complete_dim_work).
    pub fn sample(&mut self, now: Time, events: u64, packets: u64, bytes: u64) -> bool {
        let end = Sample {
            time: now,
            events,
            packets,
            bytes,
        };
        let Some(start) = self.start else {
            self.start = Some(end);
            return false;
        };
        if end.events - start.events < NEVENTS {
            return false;
        }
        // dim_calc_stats(): rates per ms, rounded up; interrupts counted as DIM_NEVENTS.
        let us = (end.time - start.time) / 1000;
        if us == 0 {
            return false;
        }
        let per_ms = |n: u64| (n * 1000).div_ceil(us);
        let curr = Stats {
            ppms: per_ms(end.packets - start.packets),
            bpms: per_ms(end.bytes - start.bytes),
            epms: per_ms(NEVENTS),
        };
        if self.decide(&curr) {
            self.applied = self.profile;
            self.start = None;
            return true;
        }
        self.start = Some(end);
        false
    }

    /// net_dim_step().
    fn step(&mut self) -> Step {
        if self.tired == 2 * PROFILES as u32 {
            return Step::TooTired;
        }
        match self.tune {
            Tune::ParkingOnTop | Tune::ParkingTired => {}
            Tune::GoingRight => {
                if self.profile == PROFILES - 1 {
                    return Step::OnEdge;
                }
                self.profile += 1;
                self.steps_right += 1;
            }
            Tune::GoingLeft => {
                if self.profile == 0 {
                    return Step::OnEdge;
                }
                self.profile -= 1;
                self.steps_left += 1;
            }
        }
        self.tired += 1;
        Step::Stepped
    }

    /// dim_park_on_top() / dim_park_tired().
    fn park(&mut self, tune: Tune) {
        self.steps_left = 0;
        self.steps_right = 0;
        if tune == Tune::ParkingOnTop {
            self.tired = 0;
        }
        self.tune = tune;
    }

    /// net_dim_exit_parking().
    fn exit_parking(&mut self) {
        self.tune = if self.profile > 0 {
            Tune::GoingLeft
        } else {
            Tune::GoingRight
        };
        self.step();
    }

    /// dim_turn().
    fn turn(&mut self) {
        match self.tune {
            Tune::GoingRight => {
                self.tune = Tune::GoingLeft;
                self.steps_left = 0;
            }
            Tune::GoingLeft => {
                self.tune = Tune::GoingRight;
                self.steps_right = 0;
            }
            _ => {}
        }
    }

    /// dim_on_top(): a step each way did worse.
    fn on_top(&self) -> bool {
        match self.tune {
            Tune::ParkingOnTop | Tune::ParkingTired => true,
            Tune::GoingRight => self.steps_left > 1 && self.steps_right == 1,
            Tune::GoingLeft => self.steps_right > 1 && self.steps_left == 1,
        }
    }

    /// net_dim_decision(): whether the profile changed.
    fn decide(&mut self, curr: &Stats) -> bool {
        let (prev_tune, prev_profile) = (self.tune, self.profile);
        match self.tune {
            Tune::ParkingOnTop => {
                if compare(curr, &self.prev) != Verdict::Same {
                    self.exit_parking();
                }
            }
            Tune::ParkingTired => {
                self.tired -= 1;
                if self.tired == 0 {
                    self.exit_parking();
                }
            }
            Tune::GoingRight | Tune::GoingLeft => {
                if compare(curr, &self.prev) != Verdict::Better {
                    self.turn();
                }
                if self.on_top() {
                    self.park(Tune::ParkingOnTop);
                } else {
                    match self.step() {
                        Step::OnEdge => self.park(Tune::ParkingOnTop),
                        Step::TooTired => self.park(Tune::ParkingTired),
                        Step::Stepped => {}
                    }
                }
            }
        }
        if prev_tune != Tune::ParkingOnTop || self.tune != Tune::ParkingOnTop {
            self.prev = *curr;
        }
        self.profile != prev_profile
    }
}

enum Step {
    Stepped,
    OnEdge,
    TooTired,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `dim` measurements of 64 interrupts each, `ms` long, with the rates `rates(profile)` gives.
    fn run(dim: &mut Dim, rounds: usize, rates: impl Fn(usize) -> (u64, u64, u64)) -> Vec<usize> {
        let (mut t, mut e, mut p, mut b) = (0u64, 0u64, 0u64, 0u64);
        let mut seen = vec![];
        dim.sample(t, e, p, b);
        for _ in 0..rounds {
            let (ms_per_64_events, ppms, bpms) = rates(dim.applied);
            t += ms_per_64_events * 1_000_000;
            e += NEVENTS;
            p += ppms * ms_per_64_events;
            b += bpms * ms_per_64_events;
            dim.sample(t, e, p, b);
            seen.push(dim.applied);
        }
        seen
    }

    #[test]
    fn with_traffic_fixed_fewer_interrupts_walk_it_to_the_last_profile_and_it_parks() {
        // Bytes and packets per ms do not depend on moderation; each profile halves the interrupt rate.
        let mut dim = Dim::new(RX_CQE_PROFILES, true);
        assert_eq!(dim.moderation().usecs, 8, "starts at the default profile");
        let seen = run(&mut dim, 20, |p| (1 << p, 1000, 1_000_000));
        assert_eq!(*seen.last().unwrap(), PROFILES - 1);
        assert_eq!(dim.tune, Tune::ParkingOnTop);
        assert_eq!(dim.moderation().usecs, 64);
    }

    #[test]
    fn when_moderating_more_costs_traffic_it_stays_left() {
        // Every step right loses 20 % of the bytes: it turns back and parks at the first profile.
        let mut dim = Dim::new(TX_EQE_PROFILES, false);
        let seen = run(&mut dim, 20, |p| {
            (1, 100, 100_000 * 10 / (10 + 2 * p as u64))
        });
        assert!(seen.iter().skip(6).all(|&p| p <= 1), "{seen:?}");
    }

    #[test]
    fn fewer_than_64_interrupts_decide_nothing() {
        let mut dim = Dim::new(RX_CQE_PROFILES, true);
        dim.sample(0, 0, 0, 0);
        assert!(!dim.sample(1_000_000, 63, 1000, 1_000_000));
        assert_eq!(dim.applied, DEF_PROFILE);
    }
}
