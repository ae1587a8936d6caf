//! Small statistics and formatting helpers, and CPU time from `/proc`.

use std::time::Duration;

/// CPU seconds a process has run (all its live threads; from schedstat, in ns).
pub fn cpu_secs(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}

/// User and system CPU seconds of this process (`/proc/self/stat`, clock ticks of 10 ms).
pub fn user_sys_secs() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / 100.0;
    // utime and stime are fields 14 and 15, i.e. indices 11 and 12 after the state.
    (tick(11), tick(12))
}

pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if !v.len().is_multiple_of(2) {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

pub fn gbit(bytes_per_sec: f64) -> String {
    format!("{:.3} Gbit/s", bytes_per_sec * 8.0 / 1e9)
}

pub fn range_note(v: &[f64]) -> String {
    if v.len() < 2 {
        return String::new();
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.2}–{hi:.2}]")
}

/// A markdown table with aligned columns; the first row is the head.
pub struct Table {
    pub rows: Vec<Vec<String>>,
    /// Right-aligned columns.
    pub right: Vec<usize>,
}

impl Table {
    pub fn new(head: &[&str], right: &[usize]) -> Self {
        Self {
            rows: vec![head.iter().map(|s| (*s).to_owned()).collect()],
            right: right.to_vec(),
        }
    }

    pub fn add(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    pub fn print(&self) {
        let cols = self.rows[0].len();
        let w: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |r: &Vec<String>| {
            let cells: Vec<String> = (0..cols)
                .map(|c| {
                    let s = r.get(c).map_or("", String::as_str);
                    let pad = " ".repeat(w[c] - s.chars().count());
                    if self.right.contains(&c) {
                        format!(" {pad}{s} ")
                    } else {
                        format!(" {s}{pad} ")
                    }
                })
                .collect();
            format!("|{}|", cells.join("|"))
        };
        println!("{}", line(&self.rows[0]));
        let sep: Vec<String> = (0..cols)
            .map(|c| {
                if self.right.contains(&c) {
                    format!("{}:", "-".repeat(w[c] + 1))
                } else {
                    "-".repeat(w[c] + 2)
                }
            })
            .collect();
        println!("|{}|", sep.join("|"));
        for r in &self.rows[1..] {
            println!("{}", line(r));
        }
    }
}
