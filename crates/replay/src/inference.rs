//! Which pool each recorded segment belongs to, decided by replaying the trace: the evidence of
//! [`pools`](crate::pools) tried in passes, each assumption the record contradicts flipped, and
//! the answers with and without the evidence of pool releases compared by how well the record
//! agrees with them.

use std::collections::HashMap;
use std::sync::Arc;

use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::MempoolId;

use crate::capacity::CapacityInference;
use crate::plan::DevicePlan;
use crate::pools::{self, PoolAttribution, PoolOf, PoolRun};
use crate::settings_phases::SettingsPhase;
use crate::{run, Result, RunOptions, DEFAULT_CAPACITY};

/// Infers the pool of every recorded segment of `plan` by replaying it under the recorded
/// configuration, taking the pools the trace names (`named`, per allocation) and flipping
/// assumptions the record contradicts (see [`pools`](crate::pools)). Segments one run of
/// releases frees, all of private pools, were released by one `empty_cache` of one pool: when the
/// inference gave them several pools, it is tried again with those pools made one, and the merged
/// answer is kept if the record agrees with it as well. `settings` are the settings the program
/// changed while it ran, as far as they are known.
pub(crate) fn infer_pools(
    plan: &DevicePlan,
    recorded: &AllocatorConfig,
    capacity: &CapacityInference,
    settings: &[SettingsPhase],
    named: &Arc<[Option<MempoolId>]>,
) -> Result<Inferred> {
    let given = Given {
        plan,
        recorded,
        capacity,
        settings,
        named,
    };
    let released = pools::released_private(plan);
    let plain = infer_pools_from(&given, HashMap::new())?;
    if released.is_empty() || plain.mismatches == 0 {
        return Ok(plain);
    }
    // Releases of private pools only say which segments were a pool's; the record has the last
    // word when it agrees better with them.
    let by_release = infer_pools_from(&given, released)?;
    Ok(if by_release.mismatches < plain.mismatches {
        by_release
    } else {
        plain
    })
}

/// What every pass of the inference replays: the plan under the recorded configuration, with the
/// capacity inferred, the settings changes known, and the pools the trace names.
struct Given<'a> {
    plan: &'a DevicePlan,
    recorded: &'a AllocatorConfig,
    capacity: &'a CapacityInference,
    settings: &'a [SettingsPhase],
    named: &'a Arc<[Option<MempoolId>]>,
}

/// One pool inference: the pool of each recorded segment, the attribution reported, the address
/// and reserved-bytes mismatches of its last pass, and the out-of-memory requests it left to
/// either pool.
pub(crate) struct Inferred {
    pub(crate) of: Vec<Option<PoolOf>>,
    pub(crate) attribution: PoolAttribution,
    pub(crate) mismatches: u64,
    pub(crate) ambiguous_ooms: Vec<u32>,
}

/// [`infer_pools_with`] from the pools `released` decides ([`pools::released_private`]); then,
/// when the inference split the segments of one run of releases between unnamed pools, with
/// those pools made one, kept if the record agrees as well.
fn infer_pools_from(given: &Given<'_>, released: HashMap<u32, MempoolId>) -> Result<Inferred> {
    let first = infer_pools_with(given, HashMap::new(), released.clone())?;
    let merges = pools::merged_release_pools(given.plan, &first.of);
    if merges.is_empty() || first.attribution.gave_up {
        return Ok(first);
    }
    let merged = infer_pools_with(given, merges, released)?;
    if merged.attribution.gave_up || merged.mismatches > first.mismatches {
        return Ok(first);
    }
    Ok(merged)
}

/// One inference from `forced` on; also the address mismatches of its last pass and the
/// out-of-memory requests it left to either pool.
fn infer_pools_with(
    given: &Given<'_>,
    mut forced: HashMap<u32, MempoolId>,
    released: HashMap<u32, MempoolId>,
) -> Result<Inferred> {
    let Given {
        plan,
        recorded,
        capacity,
        settings,
        named,
    } = *given;
    let mut options = RunOptions::new(recorded.clone());
    options.timeline_points = 1;
    options.check = true;
    let default = capacity.capacity.unwrap_or(DEFAULT_CAPACITY);
    let mut flips = 0;
    loop {
        let mut pass =
            PoolRun::inferring(plan, forced.clone(), Arc::clone(named), released.clone());
        let schedule = run::Schedule {
            limits: capacity.phases_for(recorded.per_process_memory_fraction),
            settings,
            stop_at_divergence: false,
            releases_external: None,
            program: run::ProgramSettings {
                recorded,
                phases: settings,
            },
        };
        let run = run::run_device(plan, &options, default, schedule, 0, None, &mut pass)?;
        let stop = match pass.contradiction {
            Some((instance, pool)) if flips < pools::MAX_FLIPS => {
                tracing::debug!(
                    device = plan.device,
                    segment = format_args!("{:#x}", plan.instances[instance as usize].addr),
                    %pool,
                    "the record contradicts the segment's pool: trying again with this one"
                );
                flips += 1;
                forced.insert(instance, pool);
                None
            }
            Some(_) => Some(true),
            None => Some(false),
        };
        if let Some(gave_up) = stop {
            let (shares, undecided) = PoolAttribution::build(plan, &pass.of);
            if gave_up {
                tracing::warn!(
                    device = plan.device,
                    flips,
                    "pool inference gave up: the record contradicts every assignment tried"
                );
            }
            let mismatches = run
                .check
                .map_or(0, |c| c.address_mismatches + c.reserved_mismatches);
            return Ok(Inferred {
                of: pass.of,
                attribution: PoolAttribution {
                    pools: shares,
                    undecided,
                    flips,
                    gave_up,
                    private_ooms: pass.private_ooms,
                    ooms_from_stats: 0,
                    no_split: Vec::new(),
                    own_allocator: Vec::new(),
                },
                mismatches,
                ambiguous_ooms: pass.ambiguous_ooms,
            });
        }
    }
}
