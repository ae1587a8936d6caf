//! Small statistics and formatting helpers, and CPU time from `/proc`.

pub use tether_e2e::benchkit::{cpu_secs, load_average, mean, median, percentile, range_note};

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

pub fn gbit(bytes_per_sec: f64) -> String {
    format!("{:.3} Gbit/s", bytes_per_sec * 8.0 / 1e9)
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
