//! The event log as the API reads it: a page of history, and a live feed
//! that replays from a point and then follows new events as they commit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use uuid::Uuid;

use super::Manager;
use super::error::{Error, Result};
use crate::store::{EventFilter, Store};
use blockplane_api::model::{Event, EventQuery, EventStreamQuery};

/// How long a feed waits for a commit's wake-up before it looks again anyway.
const REPOLL: Duration = Duration::from_secs(5);

/// Events of one subscriber, in order: those after its start point first
/// (the replay), then each new one as it is committed.
pub struct EventFeed {
    store: Store,
    notify: Arc<Notify>,
    volume: Option<Uuid>,
    last: i64,
    pending: VecDeque<Event>,
}

impl EventFeed {
    /// The next event, waiting for one if need be; an error of the store
    /// ends the feed.
    pub async fn next(&mut self) -> Result<Event> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Ok(ev);
            }
            // Register for the wake-up before looking, so none is missed.
            let woken = self.notify.notified();
            let batch = self.store.events_after(self.last, self.volume, 100).await?;
            match batch.last() {
                Some(ev) => {
                    self.last = ev.id;
                    self.pending.extend(batch);
                }
                None => {
                    let _ = tokio::time::timeout(REPOLL, woken).await;
                }
            }
        }
    }
}

/// The event log's reader: it reads the registry and nothing else of the
/// manager ([`Manager::events`]).
pub struct Events<'a> {
    store: &'a Store,
}

impl Manager {
    /// The event log, to read a page of it or follow it.
    pub fn events(&self) -> Events<'_> {
        Events {
            store: &self.house.store,
        }
    }
}

impl Events<'_> {
    /// The id of a volume named by id or name; a deleted volume's history
    /// stays readable by its id.
    async fn event_volume(&self, volume: Option<String>) -> Result<Option<Uuid>> {
        let Some(v) = volume else { return Ok(None) };
        match self.store.volume(&v).await? {
            Some(row) => Ok(Some(row.id)),
            None => Uuid::parse_str(&v)
                .map(Some)
                .map_err(|_| Error::VolumeNotFound(v)),
        }
    }

    /// `GET /v1/events/stream`: a feed that starts after `resume` (the
    /// `Last-Event-ID` header), else after `q.after`, else with the next event.
    pub async fn subscribe(&self, q: EventStreamQuery, resume: Option<i64>) -> Result<EventFeed> {
        let volume = self.event_volume(q.volume).await?;
        let last = match resume.or(q.after) {
            Some(id) => id,
            None => self.store.last_event_id().await?,
        };
        Ok(EventFeed {
            notify: self.store.events_added(),
            store: self.store.clone(),
            volume,
            last,
            pending: VecDeque::new(),
        })
    }

    /// `GET /v1/events`.
    pub async fn list(&self, q: EventQuery) -> Result<Vec<Event>> {
        let volume_id = self.event_volume(q.volume).await?;
        let since = q
            .since
            .map(|s| {
                time::OffsetDateTime::parse(&s, &time::format_description::well_known::Rfc3339)
                    .map_err(|e| Error::InvalidField {
                        field: "since",
                        reason: format!("'{s}' is not an RFC 3339 time: {e}"),
                    })
            })
            .transpose()?
            .map(utc_clamped);
        let limit = q.limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(Error::InvalidField {
                field: "limit",
                reason: format!("{limit} is outside 1..=1000"),
            });
        }
        Ok(self
            .store
            .events(&EventFilter {
                volume_id,
                since,
                kind: q.kind,
                limit,
            })
            .await?)
    }
}

/// `t` in UTC; a valid RFC 3339 time whose UTC falls past year 9999 or
/// before year -9999 (`9999-12-31T23:59:59-23:59`) becomes the last or first
/// representable time, as no event lies beyond either.
fn utc_clamped(t: time::OffsetDateTime) -> time::OffsetDateTime {
    t.checked_to_offset(time::UtcOffset::UTC)
        .unwrap_or_else(|| {
            if t.year() > 0 {
                time::PrimitiveDateTime::MAX.assume_utc()
            } else {
                time::PrimitiveDateTime::MIN.assume_utc()
            }
        })
}
