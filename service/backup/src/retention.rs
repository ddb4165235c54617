//! Which backups a retention policy keeps: the last N, and the newest of
//! each of the last N days, ISO weeks, months and years that have one, as
//! Proxmox Backup Server's prune decides (its documentation is the
//! reference users know). Periods are counted in UTC.
//!
//! The rules run in that order over the backups, newest first. Each rule
//! keeps the newest backup of each period it has not seen, until it has
//! kept its count; a period in which an earlier rule already kept a backup
//! is not counted again, and the other backups of a period a rule kept one
//! in are removed for the rules that follow. A backup no rule keeps is
//! removed. A policy that keeps nothing is refused by the caller: it would
//! remove every backup.

use std::collections::HashSet;

use time::OffsetDateTime;

/// How many of each to keep; 0 leaves a rule out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// The newest backups, whatever their dates.
    pub last: u32,
    /// The newest backup of each day.
    pub daily: u32,
    /// The newest backup of each ISO week.
    pub weekly: u32,
    /// The newest backup of each month.
    pub monthly: u32,
    /// The newest backup of each year.
    pub yearly: u32,
}

impl Retention {
    /// Whether the policy keeps no backup at all.
    pub fn keeps_nothing(&self) -> bool {
        [
            self.last,
            self.daily,
            self.weekly,
            self.monthly,
            self.yearly,
        ]
        .iter()
        .all(|n| *n == 0)
    }
}

/// The rule that kept a backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// One of the last N.
    Last,
    /// The newest of its day.
    Daily,
    /// The newest of its ISO week.
    Weekly,
    /// The newest of its month.
    Monthly,
    /// The newest of its year.
    Yearly,
}

impl Rule {
    /// The period a backup made at `at` falls in, for this rule; `None`
    /// for [`Rule::Last`], which has none.
    fn period(self, at: OffsetDateTime) -> Option<(i32, u32)> {
        let at = at.to_offset(time::UtcOffset::UTC);
        match self {
            Rule::Last => None,
            Rule::Daily => Some((at.year(), u32::from(at.ordinal()))),
            Rule::Weekly => {
                let (year, week, _) = at.to_iso_week_date();
                Some((year, u32::from(week)))
            }
            Rule::Monthly => Some((at.year(), u32::from(u8::from(at.month())))),
            Rule::Yearly => Some((at.year(), 0)),
        }
    }
}

/// What the policy decided for one backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Kept, by this rule.
    Keep(Rule),
    /// Removed: no rule keeps it.
    Remove,
}

/// Decides every backup of one image, given their creation times in any
/// order; the answer in the same order.
pub fn select(created: &[OffsetDateTime], policy: &Retention) -> Vec<Decision> {
    let mut newest_first: Vec<usize> = (0..created.len()).collect();
    // Newest first; equal times by position, so the answer is stable.
    newest_first.sort_by(|a, b| created[*b].cmp(&created[*a]).then(a.cmp(b)));
    let mut decided: Vec<Option<Decision>> = vec![None; created.len()];
    for i in newest_first.iter().take(policy.last as usize) {
        decided[*i] = Some(Decision::Keep(Rule::Last));
    }
    for (rule, count) in [
        (Rule::Daily, policy.daily),
        (Rule::Weekly, policy.weekly),
        (Rule::Monthly, policy.monthly),
        (Rule::Yearly, policy.yearly),
    ] {
        if count == 0 {
            continue;
        }
        let period = |i: usize| rule.period(created[i]);
        let covered: HashSet<_> = newest_first
            .iter()
            .filter(|i| matches!(decided[**i], Some(Decision::Keep(_))))
            .map(|i| period(*i))
            .collect();
        let mut kept = HashSet::new();
        for &i in &newest_first {
            if decided[i].is_some() || covered.contains(&period(i)) {
                continue;
            }
            if kept.contains(&period(i)) {
                decided[i] = Some(Decision::Remove);
            } else if kept.len() < count as usize {
                kept.insert(period(i));
                decided[i] = Some(Decision::Keep(rule));
            } else {
                break;
            }
        }
    }
    decided
        .into_iter()
        .map(|d| d.unwrap_or(Decision::Remove))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    /// The backups kept, by their dates, newest first, with their rules.
    fn kept(dates: &[OffsetDateTime], policy: Retention) -> Vec<(String, Rule)> {
        let mut out: Vec<(OffsetDateTime, Rule)> = select(dates, &policy)
            .into_iter()
            .zip(dates)
            .filter_map(|(d, at)| match d {
                Decision::Keep(r) => Some((*at, r)),
                Decision::Remove => None,
            })
            .collect();
        out.sort_by_key(|b| std::cmp::Reverse(b.0));
        out.into_iter()
            .map(|(at, r)| (format!("{}", at.date()), r))
            .collect()
    }

    fn k(date: &str, rule: Rule) -> (String, Rule) {
        (date.to_string(), rule)
    }

    /// Two backups a day at 01:00 and 13:00 from 2026-01-01 to 2026-03-31,
    /// and one on the 1st of each month of 2024 and 2025.
    fn dates() -> Vec<OffsetDateTime> {
        let mut out = Vec::new();
        let mut day = datetime!(2026-01-01 01:00 UTC);
        while day < datetime!(2026-04-01 00:00 UTC) {
            out.push(day);
            out.push(day + time::Duration::hours(12));
            day += time::Duration::days(1);
        }
        for year in [2024, 2025] {
            for month in 1..=12u8 {
                let date =
                    time::Date::from_calendar_date(year, month.try_into().unwrap(), 1).unwrap();
                out.push(date.with_hms(6, 0, 0).unwrap().assume_utc());
            }
        }
        out
    }

    #[test]
    fn keep_last_keeps_exactly_the_newest_n() {
        let got = kept(
            &dates(),
            Retention {
                last: 3,
                ..Retention::default()
            },
        );
        assert_eq!(
            got,
            [
                k("2026-03-31", Rule::Last),
                k("2026-03-31", Rule::Last),
                k("2026-03-30", Rule::Last),
            ]
        );
    }

    #[test]
    fn keep_daily_keeps_the_newest_of_each_of_the_last_n_days() {
        let got = kept(
            &dates(),
            Retention {
                daily: 3,
                ..Retention::default()
            },
        );
        assert_eq!(
            got,
            [
                k("2026-03-31", Rule::Daily),
                k("2026-03-30", Rule::Daily),
                k("2026-03-29", Rule::Daily),
            ]
        );
        // The one kept of a day is its newest, at 13:00.
        let backups = dates();
        let decisions = select(
            &backups,
            &Retention {
                daily: 1,
                ..Retention::default()
            },
        );
        let only: Vec<_> = backups
            .iter()
            .zip(decisions)
            .filter(|(_, d)| *d == Decision::Keep(Rule::Daily))
            .map(|(at, _)| *at)
            .collect();
        assert_eq!(only, [datetime!(2026-03-31 13:00 UTC)]);
    }

    #[test]
    fn keep_weekly_counts_iso_weeks_that_have_a_backup() {
        // 2026-03-31 is a Tuesday of ISO week 14; week 13 ends Sunday the
        // 29th, week 12 the 22nd.
        let got = kept(
            &dates(),
            Retention {
                weekly: 3,
                ..Retention::default()
            },
        );
        assert_eq!(
            got,
            [
                k("2026-03-31", Rule::Weekly),
                k("2026-03-29", Rule::Weekly),
                k("2026-03-22", Rule::Weekly),
            ]
        );
    }

    #[test]
    fn keep_monthly_and_yearly_reach_back_past_gaps() {
        let got = kept(
            &dates(),
            Retention {
                monthly: 5,
                yearly: 3,
                ..Retention::default()
            },
        );
        assert_eq!(
            got,
            [
                k("2026-03-31", Rule::Monthly),
                k("2026-02-28", Rule::Monthly),
                k("2026-01-31", Rule::Monthly),
                k("2025-12-01", Rule::Monthly),
                k("2025-11-01", Rule::Monthly),
                // 2026 and 2025 are covered by months kept already: the
                // yearly rule counts only years no rule kept one of.
                k("2024-12-01", Rule::Yearly),
            ]
        );
    }

    #[test]
    fn rules_combine_without_counting_a_period_twice() {
        let got = kept(
            &dates(),
            Retention {
                last: 2,
                daily: 2,
                weekly: 2,
                ..Retention::default()
            },
        );
        assert_eq!(
            got,
            [
                // Both of the 31st: the last two.
                k("2026-03-31", Rule::Last),
                k("2026-03-31", Rule::Last),
                // The 31st is covered; the next two days.
                k("2026-03-30", Rule::Daily),
                k("2026-03-29", Rule::Daily),
                // Weeks 14 and 13 are covered; the next two weeks.
                k("2026-03-22", Rule::Weekly),
                k("2026-03-15", Rule::Weekly),
            ]
        );
    }

    #[test]
    fn a_day_is_a_utc_day() {
        let at = |s: &str| {
            OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).unwrap()
        };
        // 23:30 at -02:00 is 01:30 UTC the next day: two UTC days.
        let dates = [at("2026-05-01T23:30:00-02:00"), at("2026-05-01T12:00:00Z")];
        let got = kept(
            &dates,
            Retention {
                daily: 2,
                ..Retention::default()
            },
        );
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn nothing_to_keep_is_said() {
        assert!(Retention::default().keeps_nothing());
        assert!(
            !Retention {
                yearly: 1,
                ..Retention::default()
            }
            .keeps_nothing()
        );
    }
}
