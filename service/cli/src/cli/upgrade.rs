//! `blockplane upgrade`: every volume whose worker is another build than
//! the service's is handed over to a new worker of the service's build
//! (`POST /v1/volumes/{id}/handover`), one at a time, a line each; the
//! first failure stops it, naming the volume and why.

use std::process::ExitCode;

use blockplane_api::model::{Handover, ServiceBuild, Volume};
use blockplane_client::{self as client, Client};

use super::output::{fail, print};
use super::render::json_pretty;

/// The volumes to hand over: those named (each must have a worker), else
/// every one whose worker is older (with `all`, every one with a worker).
fn chosen<'a>(list: &'a [Volume], named: &[String], all: bool) -> Result<Vec<&'a Volume>, String> {
    if named.is_empty() {
        return Ok(list
            .iter()
            .filter(|v| v.worker_version.is_some() && (all || v.worker_older == Some(true)))
            .collect());
    }
    named
        .iter()
        .map(|n| {
            let v = list
                .iter()
                .find(|v| v.name == *n || v.id.to_string() == *n)
                .ok_or_else(|| format!("volume '{n}' not found"))?;
            match v.worker_version {
                Some(_) => Ok(v),
                None => Err(format!(
                    "volume '{}' has no worker to hand over (backend {}, dispatch {}: the kernel serves it)",
                    v.name,
                    v.backend.as_str(),
                    v.dispatch.as_str()
                )),
            }
        })
        .collect()
}

/// Says that the service's file holds another build now, which volumes do
/// not move to.
fn note_replaced(build: &ServiceBuild) {
    if build.executable_replaced {
        eprintln!(
            "blockplane: note: {} now holds build {}, the service runs {}: volumes move to the service's build; restart the service first to move them to the new file's",
            build.executable,
            build.executable_version.as_deref().unwrap_or("(none)"),
            build.version
        );
    }
}

/// Says where an upgrade stopped (at `volumes[i]`, for `e`) and which
/// volumes it did not hand over.
fn stopped_at(volumes: &[&Volume], i: usize, e: &client::Error) {
    eprintln!(
        "blockplane: upgrade stopped at volume '{}' ({} of {}): {e}",
        volumes[i].name,
        i + 1,
        volumes.len()
    );
    let left: Vec<&str> = volumes[i + 1..].iter().map(|v| v.name.as_str()).collect();
    if !left.is_empty() {
        eprintln!("blockplane: not handed over: {}", left.join(", "));
    }
}

/// Runs `blockplane upgrade`.
pub async fn upgrade(client: &Client, named: &[String], all: bool, as_json: bool) -> ExitCode {
    let (host, list) = match tokio::try_join!(client.host(), client.volumes()) {
        Ok(both) => both,
        Err(e) => return fail(&e),
    };
    let build = &host.build;
    note_replaced(build);
    let volumes = match chosen(&list, named, all) {
        Ok(v) => v,
        Err(why) => {
            eprintln!("blockplane: {why}");
            return ExitCode::FAILURE;
        }
    };
    let total = volumes.len();
    if total == 0 {
        if !as_json {
            print(&format!(
                "every volume served by a worker runs the service's build {}: nothing to hand over\n",
                build.version
            ));
        } else {
            print("[]\n");
        }
        return ExitCode::SUCCESS;
    }
    if !as_json {
        print(&format!(
            "handing {total} volume(s) over to workers of build {}, one at a time\n",
            build.version
        ));
    }
    let mut done: Vec<Handover> = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        if !as_json {
            print(&format!(
                "[{}/{total}] {} ({}, worker {} of {}): ",
                i + 1,
                v.name,
                v.device.as_deref().unwrap_or("no device"),
                v.worker_pid.map_or("?".into(), |p| p.to_string()),
                v.worker_version.as_deref().unwrap_or("unknown"),
            ));
        }
        match client.handover_volume(&v.id.to_string()).await {
            Ok(h) => {
                if !as_json {
                    print(&format!(
                        "handed over by {} in {} ms to worker {}\n",
                        h.method.as_str(),
                        h.took_ms,
                        h.worker_pid
                    ));
                }
                done.push(h);
            }
            Err(e) => {
                if as_json {
                    print(&json_pretty(&done));
                } else {
                    print("failed\n");
                }
                stopped_at(&volumes, i, &e);
                return ExitCode::FAILURE;
            }
        }
    }
    if as_json {
        print(&json_pretty(&done));
    } else {
        print(&format!(
            "done: {total} volume(s) now on build {}\n",
            build.version
        ));
    }
    ExitCode::SUCCESS
}
