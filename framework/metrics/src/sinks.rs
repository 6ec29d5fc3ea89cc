//! Metric sinks beyond the console and JSONL: CSV (long format) and TensorBoard event files.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// Appends `step,split,metric,value` rows (long format: train and eval rows report different
/// metrics, so one column per metric would leave holes).
pub struct CsvSink {
    out: BufWriter<File>,
}

impl CsvSink {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(path: &Path) -> io::Result<Self> {
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(b"step,split,metric,value\n")?;
        Ok(Self { out })
    }

    /// Appends to an existing file (a resumed run's), writing the header if it is new.
    pub fn append(path: &Path) -> io::Result<Self> {
        let fresh = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
        let mut out = BufWriter::new(std::fs::OpenOptions::new().create(true).append(true).open(path)?);
        if fresh {
            out.write_all(b"step,split,metric,value\n")?;
        }
        Ok(Self { out })
    }

    /// One row per metric.
    pub fn write<'a>(
        &mut self,
        step: u64,
        split: &str,
        metrics: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> io::Result<()> {
        for (name, value) in metrics {
            writeln!(self.out, "{step},{split},{name},{value}")?;
        }
        self.out.flush()
    }
}

/// Writes TensorBoard event files (`events.out.tfevents.*`): TFRecord framing (length and
/// data, each followed by its masked CRC-32C) around `Event` protocol buffers holding scalar
/// summaries, the format TensorBoard's event reader expects.
pub struct TensorBoardSink {
    out: BufWriter<File>,
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// An `Event { wall_time = 1, step = 2, <payload> }`.
fn event(wall_time: f64, step: u64, payload: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(1 << 3 | 1); // wall_time: fixed64 double
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(2 << 3); // step: varint int64
    varint(&mut e, step);
    payload(&mut e);
    e
}

impl TensorBoardSink {
    /// Creates `dir/events.out.tfevents.<unix seconds>.trainrec` and writes the version record.
    pub fn create(dir: &Path) -> io::Result<Self> {
        let now = wall_time();
        let path = dir.join(format!("events.out.tfevents.{}.trainrec", now as u64));
        let mut sink = Self { out: BufWriter::new(File::create(path)?) };
        let version = event(now, 0, |e| bytes_field(e, 3, b"brain.Event:2"));
        sink.record(&version)?;
        sink.out.flush()?;
        Ok(sink)
    }

    fn record(&mut self, data: &[u8]) -> io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }

    /// One event with a scalar summary per metric, tagged `<split>/<metric>`.
    pub fn write<'a>(
        &mut self,
        step: u64,
        split: &str,
        metrics: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> io::Result<()> {
        let mut summary = Vec::new();
        for (name, value) in metrics {
            let mut v = Vec::new();
            bytes_field(&mut v, 1, format!("{split}/{name}").as_bytes());
            v.push(2 << 3 | 5); // simple_value: fixed32 float
            v.extend_from_slice(&(value as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        let e = event(wall_time(), step, |e| bytes_field(e, 5, &summary));
        self.record(&e)?;
        self.out.flush()
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minimal reader: checks both CRCs of every record and returns the records.
    fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked_crc(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()), masked_crc(data));
            out.push(data.to_vec());
            at += 16 + len;
        }
        out
    }

    #[test]
    fn crc32c_and_masking_match_the_tfrecord_reference_values() {
        // CRC-32C check value of "123456789" (RFC 3720).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // TFRecord's mask of a zero CRC is the mask delta.
        assert_eq!(0u32.rotate_right(15).wrapping_add(0xa282_ead8), 0xa282_ead8);
    }

    #[test]
    fn event_files_frame_version_and_scalars() {
        let dir = std::env::temp_dir().join(format!("trainrec-tb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut tb = TensorBoardSink::create(&dir).unwrap();
        tb.write(300, "eval", [("auc", 0.75), ("ne", 0.5)]).unwrap();
        drop(tb);
        let file = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
        assert!(file.file_name().unwrap().to_str().unwrap().starts_with("events.out.tfevents."));
        let recs = records(&std::fs::read(&file).unwrap());
        assert_eq!(recs.len(), 2);
        assert!(recs[0].windows(13).any(|w| w == b"brain.Event:2"));
        let e = &recs[1];
        // step 300 as a varint after the step key.
        let step_at = 9;
        assert_eq!(&e[step_at..step_at + 3], &[0x10, 0xac, 0x02]);
        assert!(e.windows(8).any(|w| w == b"eval/auc"));
        assert!(e.windows(4).any(|w| w == 0.75f32.to_le_bytes()));
        std::fs::remove_dir_all(&dir).unwrap();
        let csv = dir.with_extension("csv");
        let mut c = CsvSink::create(&csv).unwrap();
        c.write(5, "train", [("loss", 0.25)]).unwrap();
        assert_eq!(std::fs::read_to_string(&csv).unwrap(), "step,split,metric,value\n5,train,loss,0.25\n");
        std::fs::remove_file(&csv).unwrap();
    }
}
