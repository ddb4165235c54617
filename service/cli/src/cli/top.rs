//! `volume top`: every attached volume's last second, a screen a second.

use std::io::IsTerminal;
use std::process::ExitCode;

use blockplane_api::model::{HistoryPoint, StatsHistoryQuery, Volume, VolumeState};
use blockplane_client::{Client, Error};
use serde::Serialize;

use super::output::{fail, print};
use super::render::{dash, json_line};
use super::table::table;

/// One volume of a screen, as `--json` prints it.
#[derive(Serialize)]
struct Row<'a> {
    volume: &'a str,
    /// `null` until the service has sampled the volume twice.
    point: Option<HistoryPoint>,
}

/// Screens until `count` of them, or until interrupted.
pub async fn top(client: &Client, count: Option<u32>, as_json: bool) -> ExitCode {
    let clear = !as_json && std::io::stdout().is_terminal();
    let last_second = StatsHistoryQuery { seconds: Some(1) };
    let mut shown = 0;
    loop {
        let volumes = match client.volumes().await {
            Ok(v) => v,
            Err(e) => return fail(&e),
        };
        let mut rows = Vec::new();
        for v in volumes
            .iter()
            .filter(|v| matches!(v.state, VolumeState::Attached | VolumeState::Degraded))
        {
            let point = match client.volume_history(&v.id.to_string(), &last_second).await {
                Ok(h) => h.points.last().copied(),
                // A volume deleted meanwhile is not an error of the screen.
                Err(Error::Refused { .. }) => None,
                Err(_) => continue,
            };
            rows.push((v, point));
        }
        let text = if as_json {
            let frame: Vec<Row> = rows
                .iter()
                .map(|(v, point)| Row {
                    volume: &v.name,
                    point: *point,
                })
                .collect();
            json_line(&frame) + "\n"
        } else {
            screen(&rows, clear)
        };
        if !print(&text) {
            return ExitCode::SUCCESS;
        }
        shown += 1;
        if count.is_some_and(|c| shown >= c) {
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// One screen.
fn screen(rows: &[(&Volume, Option<HistoryPoint>)], clear: bool) -> String {
    let rate = |p: &Option<HistoryPoint>, x: fn(&HistoryPoint) -> f64, div: f64| {
        dash(p.map(|p| format!("{:.1}", x(&p) / div)))
    };
    let latency_ms = |p: &Option<HistoryPoint>, x: fn(&HistoryPoint) -> Option<f64>| {
        dash(
            p.and_then(|p| x(&p))
                .map(|us| format!("{:.2}", us / 1000.0)),
        )
    };
    const MIB: f64 = 1048576.0;
    let body = rows
        .iter()
        .map(|(v, p)| {
            vec![
                v.name.clone(),
                v.backend.as_str().into(),
                v.dispatch.as_str().into(),
                rate(p, |p| p.read.iops, 1.0),
                rate(p, |p| p.write.iops, 1.0),
                rate(p, |p| p.read.bytes_per_sec, MIB),
                rate(p, |p| p.write.bytes_per_sec, MIB),
                latency_ms(p, |p| p.read.latency_us),
                latency_ms(p, |p| p.write.latency_us),
                dash(p.map(|p| p.in_flight)),
            ]
        })
        .collect();
    let now = time::OffsetDateTime::now_utc();
    let mut out = String::new();
    if clear {
        out += "\x1b[H\x1b[2J";
    }
    out += &format!(
        "{:02}:{:02}:{:02} UTC  {} attached volume(s); rates over the last second, latency in ms\n",
        now.hour(),
        now.minute(),
        now.second(),
        rows.len()
    );
    out += &table(
        &[
            "VOLUME", "BACKEND", "DISPATCH", "R/S", "W/S", "RMIB/S", "WMIB/S", "R_AWAIT",
            "W_AWAIT", "INFLIGHT",
        ],
        body,
    );
    out + "\n"
}
