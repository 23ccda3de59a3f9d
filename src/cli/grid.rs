//! `attnsweep sweep`: a grid's cells listed (`--dry-run`), run (on the CPU, on GPUs, one at
//! a time for `--cell`), or written out as Slurm job arrays (`--emit slurm`), and the sweep's
//! tables written once its cells have run.

use crate::sweep;
use crate::sweep::tables;
use crate::util::atomic;
use crate::util::progress::DEFAULT_STATUS_EVERY;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub(super) struct SweepCmd {
    /// Grid file (TOML; see sweeps/ for examples).
    #[arg(long)]
    grid: PathBuf,
    /// Sweep directory [default: results/<grid name>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Validate the grid and list its cells with their state; run nothing.
    #[arg(long)]
    dry_run: bool,
    /// Cells run at once on the CPU (each gets an equal share of the cores).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// GPUs to place cells on, one cell per GPU at a time, e.g. --devices 0,1. A GPU named
    /// twice is shared: a sweep runs two cells on it at once (worth it only where one cell
    /// leaves it idle), and the cells placed on it are recorded as not alone, their rates not
    /// taken as timings.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// GPUs of --devices each train cell gets: it trains data parallel over them, whatever
    /// train.ranks its config names (the global batch kept: 1 trains one rank over all the
    /// micro-batches); evaluations and prunings run one a GPU, as many at once as --devices
    /// names. Default: the largest train.ranks of the grid's cells.
    #[arg(long, value_name = "K")]
    gpus_per_cell: Option<usize>,
    /// Run only the cells with these indices (as listed by --dry-run), e.g. --cell 3,8; a
    /// Slurm array task runs one. A listed cell's dependencies must be finished or listed too.
    #[arg(long, value_delimiter = ',')]
    cell: Vec<usize>,
    /// Run only the first N of the grid's seeds: the same cells, by id, as the grid's own, so
    /// the first replicate of every cell can finish before the others. The sweep directory's
    /// cells.json and tables then list those cells only, until a run without --seeds adds
    /// the rest.
    #[arg(long, value_name = "N")]
    seeds: Option<usize>,
    /// Run cells that failed before again.
    #[arg(long)]
    retry_failed: bool,
    /// Remove a train cell's optimizer state once the cell has finished. Its weights stay, for
    /// evaluation and --init-from. A finished cell is never resumed, and its optimizer state
    /// is twice the size of its weights: over a grid of many cells it fills a disk.
    #[arg(long)]
    drop_optimizer: bool,
    /// Train each rank's share of a step's micro-batches as one forward and backward pass
    /// (train.micro_batch): the same sequences and mean loss in fewer, larger kernels, for the
    /// activations of the whole share at once. Worth it where one micro-batch leaves kernels
    /// small (a small model on a slot of fewer GPUs than its ranks); where the share needs
    /// activation checkpointing to fit, the memory plan turns it on, which can cost more than
    /// joining saves (compare with `bench train`). Gates drawn at random are drawn alike
    /// joined or apart. Needs --devices.
    #[arg(long)]
    join_micro_batches: bool,
    /// Capture each train cell's step as a CUDA graph and replay it (train.cuda_graph): the
    /// same kernels without the host launching each (PERFORMANCE.md, the CUDA-graph entry).
    /// Taken where a cell trains on one GPU in one pass a step (with --join-micro-batches, or
    /// train.grad_accum 1) on the kernel library (bf16, head_dim 64 or 128), its gates drawing
    /// nothing at random and no ramp changing its forward each step; other cells run as
    /// without it. Needs --devices.
    #[arg(long)]
    cuda_graph: bool,
    /// Make again the weights of each finished train or prune cell whose weights are gone (a
    /// results folder is kept without them) when a cell this run starts evaluates, prunes or
    /// continues from it, and of what that cell read in turn. Its earlier files move to
    /// before_retrain/ in its folder. Cells that failed for want of those weights run again
    /// with --retry-failed. With --cell, the cells to train again must be listed too (the
    /// refusal names the list).
    #[arg(long)]
    retrain: bool,
    /// Instead of running, write a scheduler script: `slurm` writes one job array per stage
    /// and submit.sh under <out>/slurm.
    #[arg(long, value_parser = ["slurm"])]
    emit: Option<String>,
    /// No progress bars.
    #[arg(long, short)]
    quiet: bool,
    /// Where stderr is not a terminal (a Slurm log, nohup): seconds between status lines
    /// (cells done, failed and left; the running cells' steps).
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STATUS_EVERY)]
    status_every: u64,
    /// Start no cell after this many seconds: the running cells finish, the tables are
    /// written, and the same command run again goes on from there. For a time-limited job:
    /// the limit less the longest cell.
    #[arg(long, value_name = "SECONDS")]
    stop_after: Option<u64>,
}

/// The flags that place or run a sweep's work, against where it runs: --emit's job array and
/// --devices.
fn check_placement(c: &SweepCmd) -> Result<()> {
    anyhow::ensure!(
        !c.retrain || c.emit.is_none(),
        "--retrain trains a cell's dependencies again before the cell, in one run; a scheduler's \
         job array runs its cells apart, so leave it out with --emit (run the sweep with \
         --retrain where the weights are to be made, then emit the rest)"
    );
    anyhow::ensure!(
        !c.join_micro_batches || (c.emit.is_none() && !c.devices.is_empty()),
        "--join-micro-batches joins the micro-batches a cell's slot of --devices shares out; \
         give --devices, and leave it out with --emit"
    );
    anyhow::ensure!(
        !c.cuda_graph || (c.emit.is_none() && !c.devices.is_empty()),
        "--cuda-graph captures a cell's step on the GPU of its slot of --devices; give \
         --devices, and leave it out with --emit"
    );
    anyhow::ensure!(
        !c.cuda_graph || tch::Cuda::is_available(),
        "--cuda-graph captures a cell's step as a CUDA graph, and this machine has no CUDA \
         GPU: leave it out"
    );
    Ok(())
}

pub(super) fn run_sweep(c: SweepCmd) -> Result<()> {
    anyhow::ensure!(c.jobs >= 1, "--jobs must be at least 1 (got 0)");
    let mut grid = sweep::read_grid(&c.grid)?;
    if let Some(n) = c.seeds {
        anyhow::ensure!(
            c.emit.is_none() && c.cell.is_empty(),
            "--seeds runs a first part of the grid here; with --emit or --cell, whose indexes \
             are the whole grid's, leave it out"
        );
        grid.keep_first_seeds(n)?;
    }
    check_placement(&c)?;
    let cells = sweep::expand(&grid)?;
    if let Some(x) = cells.iter().find(|x| x.config.train.micro_batch != 0) {
        anyhow::bail!(
            "cell {} ({}) sets train.micro_batch, which depends on the GPUs a run gets, not on \
             what a cell computes: remove it from the grid and pass sweep --join-micro-batches",
            x.index,
            x.id
        );
    }
    if let Some(i) = c.cell.iter().find(|&&i| i >= cells.len()) {
        anyhow::bail!(
            "--cell {i}: the grid has {} cells, numbered from 0 (`sweep --dry-run` lists them)",
            cells.len()
        );
    }
    // Where the cells would run, checked before a dry run too: it refuses what the run would.
    let gpus_per_cell = match c.emit {
        Some(_) => 1,
        None => placed(&c, &cells)?,
    };
    let out = c
        .out
        .unwrap_or_else(|| PathBuf::from("results").join(&grid.name));
    if c.dry_run {
        println!(
            "{} cells in {} stages -> {}",
            cells.len(),
            grid.stages.len(),
            out.display()
        );
        let states: Vec<String> = cells
            .iter()
            .map(|cell| {
                sweep::read_status(&out.join(&cell.id)).map_or("pending".to_string(), |s| {
                    format!("{:?}", s.state).to_lowercase()
                })
            })
            .collect();
        for (cell, state) in cells.iter().zip(&states) {
            println!(
                "{:>4}  {:<22} {:<8} {:<10} {}",
                cell.index, cell.id, state, cell.stage, cell.label
            );
        }
        // What the grid costs to run, in the units a device budget is planned in.
        let trains: Vec<_> = cells
            .iter()
            .filter(|c| c.kind == sweep::StageKind::Train)
            .collect();
        let tokens: usize = trains.iter().map(|c| c.train_tokens()).sum();
        println!(
            "{} train cells, {:.1}M training tokens in all; {} eval and prune cells",
            trains.len(),
            tokens as f64 / 1e6,
            cells.len() - trains.len()
        );
        let done: Vec<bool> = states.iter().map(|s| s == "done").collect();
        println!("{}", sweep::plan(&out, &cells, &done, &c.cell).describe());
        let problems = sweep::problems(&grid, &cells);
        anyhow::ensure!(problems.is_empty(), "{}", sweep::describe(&problems));
        return Ok(());
    }
    if c.emit.is_some() {
        atomic::ensure_writable_dir(&out)?;
        let submit = sweep::emit_slurm(&c.grid, &grid, &cells, &out)?;
        println!("wrote Slurm job arrays; submit with {}", submit.display());
        return Ok(());
    }
    let args = sweep::SweepArgs {
        out: out.clone(),
        jobs: c.jobs,
        gpus_per_cell,
        devices: c.devices,
        cell: c.cell,
        retry_failed: c.retry_failed,
        drop_optimizer: c.drop_optimizer,
        join_micro_batches: c.join_micro_batches,
        cuda_graph: c.cuda_graph,
        retrain: c.retrain,
        stop_after: c.stop_after.map(std::time::Duration::from_secs),
        quiet: c.quiet,
        status_every: c.status_every,
    };
    let o = sweep::run(&grid, &cells, &args)?;
    if args.cell.is_empty() {
        tables::write_all(&out, &out, false)?;
    }
    eprintln!(
        "{}: {} cells done, {} failed, {} skipped",
        out.display(),
        o.done,
        o.failed,
        o.skipped
    );
    if o.stopped {
        eprintln!(
            "stopped starting cells after --stop-after {} s; run the same command again to go on",
            c.stop_after.unwrap_or_default()
        );
    }
    // Cells that failed before and were skipped now count too: the sweep is not complete.
    let failed = sweep::failed_cells(&cells, &args);
    anyhow::ensure!(
        failed.is_empty(),
        "{} cells failed ({}); their errors are in <cell>/status.json and log.txt (rerun with \
         --retry-failed)",
        failed.len(),
        failed.join(", ")
    );
    Ok(())
}

/// The GPUs a cell's slot of --devices holds, refused before any cell runs where the slots or
/// the cells' micro-batches do not share out.
fn placed(c: &SweepCmd, cells: &[sweep::Cell]) -> Result<usize> {
    let ranks = cells
        .iter()
        .map(|x| x.config.train.ranks)
        .max()
        .unwrap_or(1);
    let gpus_per_cell = slot_size(c.gpus_per_cell, &c.devices, ranks)?;
    // A cell on a slot of k GPUs trains k ranks, each a share of the step's micro-batches.
    let uneven = cells.iter().find(|x| {
        x.kind == sweep::StageKind::Train
            && !c.devices.is_empty()
            && (c.cell.is_empty() || c.cell.contains(&x.index))
            && x.config.train.grad_accum % gpus_per_cell != 0
    });
    if let Some(x) = uneven {
        anyhow::bail!(
            "cell {} ({}) takes train.grad_accum = {} micro-batches a step, which {gpus_per_cell} \
             GPUs a cell cannot share out evenly: pass a --gpus-per-cell that divides it",
            x.index,
            x.id,
            x.config.train.grad_accum
        );
    }
    Ok(gpus_per_cell)
}

/// The GPUs of --devices each train cell takes: `explicit` (--gpus-per-cell), else the
/// grid's largest train.ranks where devices are named, else 1. A default that does not fit
/// the devices names the option that does (a cell over fewer GPUs keeps its global batch).
fn slot_size(explicit: Option<usize>, devices: &[usize], ranks: usize) -> Result<usize> {
    anyhow::ensure!(
        explicit != Some(0),
        "--gpus-per-cell must be at least 1 (got 0)"
    );
    let k = explicit.unwrap_or(if devices.is_empty() { 1 } else { ranks });
    if explicit.is_none() && !devices.is_empty() && devices.len() % k != 0 {
        let fits: Vec<String> = (1..=devices.len())
            .filter(|d| devices.len() % d == 0 && ranks % d == 0)
            .map(|d| d.to_string())
            .collect();
        anyhow::bail!(
            "the grid's cells train over {ranks} GPUs (train.ranks) and --devices names {}: \
             pass --gpus-per-cell {} to train each cell over fewer (the same global batch, \
             train.grad_accum shared out among them)",
            devices.len(),
            fits.join(" or ")
        );
    }
    anyhow::ensure!(
        k >= 1 && (devices.is_empty() || devices.len() % k == 0),
        "--gpus-per-cell {k} does not divide the {} GPUs of --devices into whole slots",
        devices.len()
    );
    anyhow::ensure!(
        k == 1 || !devices.is_empty(),
        "--gpus-per-cell {k} places cells on GPUs: name them with --devices"
    );
    // A cell's ranks need a GPU each (NCCL refuses two ranks on one).
    for slot in devices.chunks(k) {
        if let Some(g) = slot
            .iter()
            .find(|g| slot.iter().filter(|x| x == g).count() > 1)
        {
            anyhow::bail!(
                "--devices names GPU {g} twice in one cell's slot of {k} GPUs, and a cell's \
                 ranks cannot share a GPU: to run two cells on each GPU, repeat the whole list \
                 (e.g. --devices 0,1,0,1 --gpus-per-cell 2)"
            );
        }
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::slot_size;

    /// A slot defaults to the grid's ranks where devices are named and to 1 without them;
    /// a default that does not fit the devices names the sizes that do, an explicit size
    /// that does not divide them is refused, and a slot of several GPUs needs devices.
    #[test]
    fn slots_default_to_the_ranks_and_name_what_fits() {
        assert_eq!(slot_size(None, &[0, 1, 2, 3], 4).unwrap(), 4);
        assert_eq!(slot_size(None, &[], 4).unwrap(), 1);
        assert_eq!(slot_size(Some(1), &[0], 4).unwrap(), 1);
        let e = slot_size(None, &[0], 4).unwrap_err().to_string();
        assert!(
            e.contains("--gpus-per-cell 1 ") && e.contains("train.ranks"),
            "{e}"
        );
        let e = slot_size(None, &[0, 1], 4).unwrap_err().to_string();
        assert!(e.contains("--gpus-per-cell 1 or 2 "), "{e}");
        let e = slot_size(Some(3), &[0, 1], 4).unwrap_err().to_string();
        assert!(e.contains("does not divide"), "{e}");
        let e = slot_size(Some(2), &[], 4).unwrap_err().to_string();
        assert!(e.contains("name them with --devices"), "{e}");
        // Two cells a GPU: allowed where each slot names distinct GPUs.
        assert_eq!(slot_size(Some(1), &[0, 0], 4).unwrap(), 1);
        assert_eq!(slot_size(Some(2), &[0, 1, 0, 1], 4).unwrap(), 2);
        let e = slot_size(Some(2), &[0, 0], 4).unwrap_err().to_string();
        assert!(e.contains("GPU 0 twice") && e.contains("0,1,0,1"), "{e}");
    }
}
