//! The panics of a command kept as messages: the hook keeps the first one's message and place,
//! and the command line reports it as an error (`cli::main`), or a command that goes on after
//! a failed case (`bench train`) reports it with that case.

/// The message and place of the first panic, kept by the panic hook.
static PANIC: std::sync::Mutex<Option<(String, String)>> = std::sync::Mutex::new(None);

/// Installs the hook that keeps the first panic's message and place (the first is the cause;
/// a scope re-raising a worker's panic comes after it).
pub(super) fn keep_first() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        // A reader that stopped reading (`attnsweep ... | head`): the command ends as a
        // Unix tool ends on SIGPIPE, quietly, instead of reporting a failure of its own.
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            eprintln!("attnsweep: standard output was closed by its reader; stopping here");
            std::process::exit(141);
        }
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        if let Ok(mut first) = PANIC.lock() {
            first.get_or_insert((msg, at));
        }
    }));
}

/// The kept panic's message and place, taken (empty if none).
pub(super) fn take() -> (String, String) {
    PANIC
        .lock()
        .ok()
        .and_then(|mut p| p.take())
        .unwrap_or_default()
}

/// The cause in a message that may carry libtorch's error: the message up to its C++
/// backtrace (`\nframe #0: ...`, written as escaped newlines in a panic's debug text), without
/// tch's wrapping (`Torch("...")`, `Internal torch error: `) or libtorch's `[enforce fail at
/// FILE:LINE] CONDITION.` prefix; what comes before them (an error's context) is kept.
pub(super) fn torch_cause(msg: &str) -> String {
    let msg = msg.replace("called `Result::unwrap()` on an `Err` value: ", "");
    let (context, torch) = ["Torch(\"", "Internal torch error: "]
        .iter()
        .find_map(|w| msg.split_once(w))
        .unwrap_or(("", &msg));
    let end = ["\\n", "\n", "Exception raised from", "frame #0"]
        .iter()
        .filter_map(|m| torch.find(m))
        .min()
        .unwrap_or(torch.len());
    let mut cause = torch[..end].trim();
    if let Some((_, rest)) = cause.split_once("[enforce fail at ") {
        cause = rest.split_once("] ").map_or(rest, |x| x.1);
        if let Some((condition, message)) = cause.split_once(". ") {
            if condition.contains("==") || condition.contains("!=") {
                cause = message;
            }
        }
    }
    format!("{context}{cause}").trim().to_string()
}

/// The cause of the panic the hook kept (`torch_cause` of its message), taken: for a command
/// that catches a failed case and goes on (`bench train`). A libtorch error is its own
/// cause; any other panic is a bug, named with its place.
pub(super) fn last_panic() -> String {
    let (msg, at) = take();
    match (
        msg.is_empty(),
        msg.contains("Torch(") || msg.contains("torch error"),
    ) {
        (true, _) => "failed without a message".into(),
        (false, true) => torch_cause(&msg),
        (false, false) => format!("{}{at} (please report it)", torch_cause(&msg)),
    }
}

/// What `f` returns, its error or its panic as the message: a bench's case that fails, kept as
/// its row's note while the other cases go on.
pub(super) fn caught<T>(f: impl FnOnce() -> anyhow::Result<T>) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| format!("{e:#}")),
        Err(_) => Err(last_panic()),
    }
}
