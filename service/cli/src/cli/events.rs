//! `events --follow`: the events asked for, then each new one as the
//! service records it.

use std::process::ExitCode;

use blockplane_api::model::{Event, EventQuery, EventStreamQuery};
use blockplane_client::{Client, Error};

use super::output::{fail, print};
use super::render::{at, json_line};

/// The events of `query`, then each new one, one per line (one JSON object
/// per line with --json), until interrupted or the service stops.
pub async fn follow(client: &Client, query: &EventQuery, as_json: bool) -> ExitCode {
    let show = |e: &Event| {
        print(&if as_json {
            json_line(e) + "\n"
        } else {
            line(e)
        })
    };
    let past = match client.events(query).await {
        Ok(past) => past,
        Err(e) => return fail(&e),
    };
    for e in &past {
        if !show(e) {
            return ExitCode::SUCCESS;
        }
    }
    let next = EventStreamQuery {
        volume: query.volume.clone(),
        after: past.last().map(|e| e.id),
    };
    let mut stream = match client.event_stream(&next).await {
        Ok(stream) => stream,
        Err(Error::Refused { status, .. }) => {
            eprintln!(
                "blockplane: the event stream answered HTTP {}",
                status.as_u16()
            );
            return ExitCode::FAILURE;
        }
        Err(e) => return fail(&e),
    };
    loop {
        match stream.next().await {
            Some(Ok(e)) => {
                if !show(&e) {
                    return ExitCode::SUCCESS;
                }
            }
            // An event this build cannot read (a newer service's) is skipped.
            Some(Err(Error::Unexpected { .. })) => {}
            Some(Err(_)) | None => break,
        }
    }
    eprintln!("blockplane: the event stream ended (the service stopped)");
    ExitCode::FAILURE
}

/// One event on one line.
fn line(e: &Event) -> String {
    format!("{}  {}  {}  {}\n", e.id, at(e.at), e.kind, e.message)
}
