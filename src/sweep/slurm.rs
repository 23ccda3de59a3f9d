//! Slurm job arrays for a grid: one array per stage, each waiting for the one before.

use super::grid::{Cell, Grid};
use crate::util::atomic;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Writes a Slurm job array per stage (one array task per cell, each running
/// `attnsweep sweep --grid G --cell K`) and `submit.sh`, which submits them in stage order,
/// each stage waiting for the previous one.
pub(crate) fn emit_slurm(
    grid_path: &Path,
    grid: &Grid,
    cells: &[Cell],
    out: &Path,
) -> Result<PathBuf> {
    let dir = out.join("slurm");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let exe = std::env::current_exe()?;
    let grid_abs = std::fs::canonicalize(grid_path)?;
    let out_abs = std::fs::canonicalize(out)?;
    let mut submit = String::from("#!/usr/bin/env bash\n# Submits the sweep's stages in order; each stage waits for the one before.\nset -euo pipefail\ncd \"$(dirname \"$0\")\"\nprev=\n");
    for stage in &grid.stages {
        let idx: Vec<usize> = cells
            .iter()
            .filter(|c| c.stage == stage.name)
            .map(|c| c.index)
            .collect();
        let (Some(&lo), Some(&hi)) = (idx.first(), idx.last()) else {
            bail!("stage {:?} has no cells", stage.name);
        };
        // A stage whose cells train data parallel asks for one node with their GPUs; the
        // cell's own launcher starts the ranks there.
        let ranks = cells
            .iter()
            .filter(|c| c.stage == stage.name)
            .map(|c| c.config.train.ranks)
            .max()
            .unwrap_or(1);
        let gpus = match ranks {
            1 => String::new(),
            k => format!("#SBATCH --nodes=1 --gres=gpu:{k}\n"),
        };
        let script = format!(
            "#!/usr/bin/env bash\n#SBATCH --job-name={name}-{stage}\n#SBATCH --array={lo}-{hi}\n#SBATCH --output={out}/slurm/{stage}-%a.log\n{gpus}# Site options (partition, time, --gres=gpu:1, ...) go here or on the sbatch command line.\nset -euo pipefail\ncd {cwd}\nexec {exe} sweep --grid {grid} --out {out} --cell \"$SLURM_ARRAY_TASK_ID\" --quiet\n",
            name = grid.name,
            stage = stage.name,
            out = out_abs.display(),
            cwd = std::env::current_dir()?.display(),
            exe = exe.display(),
            grid = grid_abs.display(),
        );
        atomic::write_bytes(
            &dir.join(format!("{}.sbatch", stage.name)),
            script.as_bytes(),
        )?;
        submit.push_str(&format!(
            "jid=$(sbatch --parsable ${{prev:+--dependency=afterany:$prev}} {}.sbatch)\necho \"stage {}: job $jid\"\nprev=$jid\n",
            stage.name, stage.name
        ));
    }
    let submit_path = dir.join("submit.sh");
    atomic::write_bytes(&submit_path, submit.as_bytes())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&submit_path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(submit_path)
}
